import sys

from grpo.cli import main

sys.exit(main())
