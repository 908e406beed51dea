"""The classroom: one JupyterHub for a whole class (``nvlab classroom up/down``).

``roster`` reads and checks the trainer's roster and hands out GPUs; ``seed`` gives each student a copy of the labs
that a later course version never overwrites; ``hub`` is the hub's one configuration (local processes or Docker
containers); ``manage`` starts and stops the hub and its accounts; ``progress_service`` is the trainer's page of the
class's progress (a hub service). JupyterHub, NativeAuthenticator, DockerSpawner and the idle culler come from the
``classroom`` extra and are imported only where the hub runs."""

import os
from pathlib import Path

# the hub's state (database, cookie secret, API token, plan, log), mode 0700
DEFAULT_STATE = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "nvlab" / "classroom"
