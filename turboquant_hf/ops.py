"""Kept so that `import turboquant_hf.ops` keeps working: this name is bound to the module
`turboquant_hf.modeling.ops` itself."""

import sys

from .modeling import ops

sys.modules[__name__] = ops
