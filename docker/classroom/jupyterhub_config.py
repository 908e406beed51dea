# The classroom hub's configuration in its container: the course's one configuration (nvlab/classroom/hub.py),
# filled from the plan `nvlab classroom up` wrote into the mounted state folder. A trainer's own settings (for
# example OAuthenticator instead of NativeAuthenticator) go in the state folder's extra_config.py.
import os

from nvlab.classroom.hub import configure

configure(c, "/srv/nvlab/state/plan.json")  # noqa: F821 (c is JupyterHub's config object)
if os.path.isfile("/srv/nvlab/state/extra_config.py"):
    load_subconfig("/srv/nvlab/state/extra_config.py")  # noqa: F821
