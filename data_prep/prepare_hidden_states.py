"""`pr-specforge data hidden-states`: see `python data_prep/prepare_hidden_states.py --help` and docs/data_prep.md."""
import sys

from pr_specforge.data.cli import main

sys.exit(main(["hidden-states", *sys.argv[1:]]))
