"""``python -m benchmarks.cluster [--cleanup | --cleanup-all]``: list or remove the emulator's namespaces."""

import sys

from .netns import main

sys.exit(main())
