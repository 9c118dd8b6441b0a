"""Kept so that `import turboquant_hf.evaluation` keeps working: this name is bound to the module
`turboquant_hf.reporting.evaluation` itself."""

import sys

from .reporting import evaluation

sys.modules[__name__] = evaluation
