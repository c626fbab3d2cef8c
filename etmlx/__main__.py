"""`python -m etmlx ...` is the `etmlx` command."""

import sys

from backends.mlx.cli.main import main

sys.exit(main())
