"""``python -m finetune train|export ...``."""

import sys

from finetune.cli import main

sys.exit(main())
