"""`python -m dflash_mlx.torch_train ...`: see train.py."""

import sys

from .train import main

sys.exit(main())
