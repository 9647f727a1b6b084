import sys

from shardfc.cli import main

sys.exit(main())
