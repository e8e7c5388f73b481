"""`pr-specforge data smollm2-target`: see `python data_prep/make_smollm2_target.py --help` and docs/data_prep.md."""
import sys

from pr_specforge.data.cli import main

sys.exit(main(["smollm2-target", *sys.argv[1:]]))
