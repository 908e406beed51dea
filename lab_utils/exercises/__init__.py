"""Exercise checks for each lab: ``lab00.q1``, ``lab01.q2``, ... on the framework in ``framework`` (value and code
exercises, ``run_student``). Importing a module here starts no work."""
