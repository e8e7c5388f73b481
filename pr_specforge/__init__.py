"""pr_specforge: Parallel Reconsideration (PR) drafters on top of SpecForge 0.2.0.

Importing the package is cheap; heavy modules (torch, SpecForge) are imported by
the sub-modules that need them. ``pr_specforge.modeling`` registers the PR draft
architecture with SpecForge's draft registry when imported.
"""

__version__ = "0.1.0"
