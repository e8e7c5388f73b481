"""`pr-specforge data conversations`: see `python data_prep/prepare_conversations.py --help` and docs/data_prep.md."""
import sys

from pr_specforge.data.cli import main

sys.exit(main(["conversations", *sys.argv[1:]]))
