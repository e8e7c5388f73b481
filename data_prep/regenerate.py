"""`pr-specforge data regenerate`: see `python data_prep/regenerate.py --help` and docs/data_prep.md."""
import sys

from pr_specforge.data.cli import main

sys.exit(main(["regenerate", *sys.argv[1:]]))
