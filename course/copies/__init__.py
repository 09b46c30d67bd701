"""Copy detection: is a hole's body the learner's own?

Who runs it: the grader (``course.grading``), after a checkout is graded. ``fingerprint.py`` turns
a hole body into winnowed k-grams of its normalised syntax tree (renaming, reordering and no-op
lines wash out); ``copycheck.py`` compares them with the reference, between classmates of one run
and with earlier submissions, finds holes that hand their job to given code, and walks a checkout
for symlinks and files changed outside the chapter. Its flags are for a human; they never change points.
"""
