"""Exercise checks for each lab: ``lab00.q1``, ``lab01.q2``, ... Importing a module here starts no work."""
