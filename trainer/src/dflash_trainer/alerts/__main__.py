import sys

from dflash_trainer.alerts.cli import main

sys.exit(main())
