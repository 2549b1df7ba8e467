"""Pure-PyTorch references for every Oink op: the correctness oracle and the fallback.

Same signatures as the public ``oink.<op>`` functions, fp32 arithmetic, outputs in the
input's dtype unless a docstring says otherwise. No validation here: the public API does it.
``cross_entropy_backward_`` (in place) backs ``oink.cross_entropy(..., inplace_backward=True)``;
``cross_entropy_fwd_bwd_`` (in place) the chunks of ``oink.linear_cross_entropy``.
"""
from . import cross_entropy, fp8, norms, nvfp4, rope, softmax
from .cross_entropy import *  # noqa: F401,F403  (each family's references, re-exported)
from .cross_entropy import cross_entropy_backward_, cross_entropy_fwd_bwd_  # noqa: F401  (internal ops)
from .fp8 import *  # noqa: F401,F403  (each family's references, re-exported)
from .norms import *  # noqa: F401,F403  (each family's references, re-exported)
from .nvfp4 import *  # noqa: F401,F403  (each family's references, re-exported)
from .rope import *  # noqa: F401,F403  (each family's references, re-exported)
from .rope import fused_qk_norm_rope  # noqa: F401  (vLLM's op: torch.ops.oink.fused_qk_norm_rope only)
from .softmax import *  # noqa: F401,F403  (each family's references, re-exported)
from .vllm_fp8 import *  # noqa: F401,F403  (vLLM's ops: torch.ops.oink.<name> only, not in __all__)

__all__ = [*norms.__all__, *softmax.__all__, *cross_entropy.__all__, *nvfp4.__all__, *fp8.__all__,
           *rope.__all__]
# every op's bench entry, by name (each family module's, beside its references; see .bench)
BENCH = {**norms.BENCH, **softmax.BENCH, **cross_entropy.BENCH, **nvfp4.BENCH, **fp8.BENCH, **rope.BENCH}
