"""The course's command (``nvlab``): what a trainer, a maintainer and CI run, above the labs' library.

``cli`` is the command line; ``ops`` executes notebooks, generates the labs from their solutions, paces them and
builds offline wheelhouses; ``classroom`` runs one JupyterHub for a class. Notebooks import ``lab_utils``, never
this package; this package imports ``lab_utils``."""
