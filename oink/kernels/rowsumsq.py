"""Row-wise sum of squares: the smallest kernel that exercises the reduction base end to end
(128-bit tiled loads, predication, warp/block/cluster reduction). Used to prove the compile
infrastructure on CPU for both archs and on the GPU against its reference."""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .reduction import RowKernelBase, add
from .row_rules import RowLaunch, pick_row_launch


class RowSumSquares(RowKernelBase):
    def __init__(self, dtype, launch: RowLaunch):
        super().__init__(launch)
        self.dtype = dtype

    @cute.jit
    def __call__(self, px: cute.Pointer, pout: cute.Pointer, M: Int32, ldx: Int64, stream: cuda.CUstream):
        mX = self.matrix(px, M, ldx)
        mO = cute.make_tensor(pout, cute.make_layout((M,)))
        tc = self.tiled_copy(self.dtype)
        self.launch_rows(self.kernel(mX, mO, tc), M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor, tc: cute.TiledCopy):
        L = self.launch
        bidx, cy, buf, mbar, part = self.cta_setup(tc)

        M = cute.size(mX, mode=[0])
        tXgX = part(mX, bidx)
        tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXrX.fill(0)
        row = tXcX[0][0]
        if row < M:
            for i in cutlass.range_constexpr(cute.size(tXgX, mode=[2])):
                if const_expr(L.even_n):
                    cute.autovec_copy(tXgX[None, None, i], tXrX[None, None, i])
                else:
                    if tXcX[(0, 0), 0, i][1] < L.N:
                        cute.autovec_copy(tXgX[None, None, i], tXrX[None, None, i])
        x = tXrX.load().to(Float32)
        s = (x * x).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        self.wait_cluster()
        s = self.row_allreduce(s, add, Float32(0.0), buf, mbar, 0)
        is_leader = tXcX[0][1] == 0
        if const_expr(L.cluster_n > 1):
            is_leader = is_leader and cy == 0
        if is_leader and row < M:
            mO[row] = s
        self.launch_dependents()


@memo
def compiled_rowsumsq(dtype_name: str, N: int, arch: str, launch: RowLaunch | None = None):
    """Compile (or fetch) the kernel for (dtype, N, launch, arch); M and the row stride stay runtime."""
    dt = cute_dtype(dtype_name)
    launch = launch or pick_row_launch(N, dt.width)

    def build():
        k = RowSumSquares(dt, launch)
        return compile_kernel(k, gmem_ptr(dt), gmem_ptr(Float32, 4), Int32(1), Int64(launch.vec),
                              fake_stream(), arch=arch)

    return CACHE.get(("rowsumsq", dtype_name, N, launch, arch), build)


def rowsumsq(x, out=None, arch: str | None = None):
    """sum(x**2, -1) in fp32 for a CUDA tensor x [M, N] (rows may be padded; last dim contiguous)."""
    import torch

    from ..arch import arch_for_capability
    from .compile import current_stream

    assert x.dim() == 2 and x.stride(1) == 1
    M, N = x.shape
    out = torch.empty(M, device=x.device, dtype=torch.float32) if out is None else out
    if M == 0:
        return out
    arch = arch or arch_for_capability(*torch.cuda.get_device_capability(x.device))
    fn = compiled_rowsumsq(str(x.dtype), N, arch)
    fn(x.data_ptr(), out.data_ptr(), M, x.stride(0), current_stream(x.device))
    return out
