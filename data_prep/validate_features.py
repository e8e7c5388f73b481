"""`pr-specforge data validate`: see `python data_prep/validate_features.py --help` and docs/data_prep.md."""
import sys

from pr_specforge.data.cli import main

sys.exit(main(["validate", *sys.argv[1:]]))
