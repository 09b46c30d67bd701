"""Pictures and figures: the notebook's drawings (``viz``), the chapter README's pictures saved from
them (``chapter``), the chapter's worked example as a real run (``example``), the notebook runner
(``notebooks``) and every back-of-envelope figure the chapter quotes, worked out (``arithmetic``).

Who runs it: notebook readers (``make notebooks``), chapter editors (``make figures``).
"""
