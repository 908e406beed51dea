import sys

from nvlab.cli import main

sys.exit(main())
