"""What runs inside the traced program: every module here is imported in the job's own process (its interpreter,
its libraries), after the native shim is loaded and before the user's code, and patches torch for good.

Nothing here runs in the estimator. The estimator's side of the boundary is the parent package: `xmem.trace.runner`
starts this side through `xmem.trace.sandbox` (or the warm server, `warm_server` here, which the client
`xmem.trace.warm` starts), and this side takes from it only `events` (the Trace record it writes back), `errors`,
`wire` (what crosses the boundary: the request with the fake GPU, the notes, the warm tracer's socket frames),
`shim.load_shim` (the native part the runner built) and `sandbox.install_in_child` (the fallback sandbox's
redirected writes, in every process the program starts); `warm_server` also `sandbox.main`, which each warm job
runs in-process.

`main` (the child's life: `python -m xmem.trace`), `fakecuda` (every patch of torch that makes a GPU appear),
`recorder` (routing, allocations, training phases), `standins` (values Python takes out of a GPU tensor), `attention`
(SDPA backend choice), `distributed` (one rank of a launcher's world), `deepspeed_ops`, `triton_launch`,
`cuda_driver` (what reaches the driver), `weights` (checkpoints as fake tensors), `shortcuts` (cached fake kernels),
`facts` (the self-audit's facts), `attribution` (whose fault a failure is), `follow` and `boot/` (every Python process
the program starts, traced the same way), `on_import` (patches applied when a library is first imported),
`warm_server` (the warm tracer's server: the tracer preloaded in the job's interpreter, forking one job per
estimate).
"""
