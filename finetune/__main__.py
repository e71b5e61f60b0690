"""``python -m finetune train|export|plan|doctor|report ...``."""

import sys

from finetune.cli import main

sys.exit(main())
