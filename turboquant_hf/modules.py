"""Kept so that `import turboquant_hf.modules` keeps working: this name is bound to the module
`turboquant_hf.modeling.modules` itself."""

import sys

from .modeling import modules

sys.modules[__name__] = modules
