"""Running a learner's code where it can harm nothing: the grader's isolation room.

Who runs it: the grader (``course.grading``), never a learner. ``sandbox.py`` starts bubblewrap with
limits for the sandbox as a whole (a private uid per job, size-capped tmpfs, a memory cgroup where
the machine has one) and reads back what it wrote without following links or blocking;
``watchdog.py`` runs the sandboxed pytest and scenario children under time limits, start-up
included; ``allowlist.py`` builds the only view of the course a sandbox gets (given files, never the
reference); ``parsing.py`` reads a learner's source in a limited child, never in the grader itself; ``leftovers.py``
names what a grader leaves on the machine after its owner, so the next run removes a dead grader's.
"""
