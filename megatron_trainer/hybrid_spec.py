"""``--spec megatron_trainer.hybrid_spec hybrid_stack_spec``: bitparity's local (non-TE) HybridStack spec
(`hybrid.stack_spec`) for Megatron-LM's ``pretrain_hybrid.py``, whose ``--spec`` takes a module attribute (megatron's
``spec_utils.import_module`` reads it from the module's namespace).  Megatron-LM imports it after parsing the job's
arguments (``argument_utils.hybrid_config_from_args``), so the spec follows the job's ``--qk-layernorm`` as GPT's
local spec follows its config.  Importing this module imports megatron-core."""
from megatron.training.global_vars import get_args

from .hybrid import stack_spec

try:
    _QK_LAYERNORM = bool(get_args().qk_layernorm)
except AssertionError:          # imported outside a Megatron-LM job: bitparity's DeepSeek-V3 (qk layernorms on)
    _QK_LAYERNORM = True

hybrid_stack_spec = stack_spec(qk_layernorm=_QK_LAYERNORM)
