//! Kernels launched through one-node CUDA graphs: a graph instantiated once, whose node's grid and
//! arguments are set before each launch, costs the calling thread about half of what
//! `cuLaunchKernel` does (on the H200s, 2.1-2.5 µs against 3.9-4.5 µs for a one-thread kernel,
//! `scripts/probes/driver_calls.c`), and the host sees the kernel done no later.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{CUDA_KERNEL_NODE_PARAMS, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUstream};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use crate::error::{Error, Result};

driver_calls! {
    /// A new empty graph.
    ///
    /// # Safety
    /// A context is bound to the calling thread.
    unsafe fn graph_create() -> CUgraph = cuGraphCreate {
        let mut graph = std::ptr::null_mut();
        // SAFETY: a valid out pointer and no flags; a context is bound (caller).
        unsafe { cuGraphCreate(&mut graph, 0) }.result()?;
        Ok(graph)
    }

    /// Adds a kernel node without dependencies to `graph`.
    ///
    /// # Safety
    /// `graph` is live; `params` names a function of the bound context, and its arguments point
    /// at values that match the function's parameters (read during the call).
    unsafe fn graph_add_kernel_node(graph: CUgraph, params: &CUDA_KERNEL_NODE_PARAMS) -> CUgraphNode = cuGraphAddKernelNode_v2 {
        let mut node = std::ptr::null_mut();
        // SAFETY: a valid out pointer, no dependencies; the graph and parameters are valid (caller).
        unsafe { cuGraphAddKernelNode_v2(&mut node, graph, std::ptr::null(), 0, params) }.result()?;
        Ok(node)
    }

    /// Instantiates `graph`.
    ///
    /// # Safety
    /// `graph` is live and its context bound.
    unsafe fn graph_instantiate(graph: CUgraph) -> CUgraphExec = cuGraphInstantiateWithFlags {
        let mut exec = std::ptr::null_mut();
        // SAFETY: a valid out pointer and no flags; the graph is valid (caller).
        unsafe { cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result()?;
        Ok(exec)
    }

    /// Sets the grid and arguments of kernel node `node` for the next launches of `exec`.
    ///
    /// # Safety
    /// `exec` was instantiated from the graph of `node`; `params` names the node's function and
    /// its arguments point at values that match the function's parameters (read during the call).
    unsafe fn graph_exec_kernel_node_set_params(
        exec: CUgraphExec,
        node: CUgraphNode,
        params: &CUDA_KERNEL_NODE_PARAMS,
    ) -> () = cuGraphExecKernelNodeSetParams_v2 {
        // SAFETY: as the caller guarantees.
        unsafe { cuGraphExecKernelNodeSetParams_v2(exec, node, params) }.result()
    }

    /// Launches `exec` on `stream`: after the work issued to `stream` before, and after the last
    /// launch of `exec`.
    ///
    /// # Safety
    /// `exec` is live; `stream` is a live stream of its context, bound to the thread.
    unsafe fn graph_launch(exec: CUgraphExec, stream: CUstream) -> () = cuGraphLaunch {
        // SAFETY: as the caller guarantees.
        unsafe { cuGraphLaunch(exec, stream) }.result()
    }

    /// Destroys `exec` (freed once a launch still running is done).
    ///
    /// # Safety
    /// `exec` is live and not used again.
    unsafe fn graph_exec_destroy(exec: CUgraphExec) -> () = cuGraphExecDestroy {
        // SAFETY: as the caller guarantees.
        unsafe { cuGraphExecDestroy(exec) }.result()
    }

    /// Destroys `graph`.
    ///
    /// # Safety
    /// `graph` is live and not used again.
    unsafe fn graph_destroy(graph: CUgraph) -> () = cuGraphDestroy {
        // SAFETY: as the caller guarantees.
        unsafe { cuGraphDestroy(graph) }.result()
    }
}

/// The most 8-byte arguments a [`KernelGraph`] passes.
const MAX_ARGS: usize = 8;

/// A kernel launched through a one-node graph of its own, instantiated once: each launch sets the
/// node's grid and 8-byte arguments (device pointers and `unsigned long long`), then launches the
/// graph. The launches of one graph run one after another, whatever their streams: a graph shared
/// by callers that do not wait for their launches would tie each to the others' streams.
pub(crate) struct KernelGraph {
    ctx: Arc<CudaContext>,
    /// Keeps the function's module loaded.
    function: CudaFunction,
    graph: CUgraph,
    exec: CUgraphExec,
    node: CUgraphNode,
    block: u32,
}

// SAFETY: the graph's handles are used only with its context bound, by one thread at a time
// (launches take `&mut self`), and destroyed once.
unsafe impl Send for KernelGraph {}

/// Kernel node parameters: `f` on `grid` blocks of `block` threads with the arguments `ptrs` point at.
fn params(f: CUfunction, grid: u32, block: u32, ptrs: &mut [*mut c_void; MAX_ARGS]) -> CUDA_KERNEL_NODE_PARAMS {
    CUDA_KERNEL_NODE_PARAMS {
        func: f,
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        kernelParams: ptrs.as_mut_ptr(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    }
}

/// Pointers to each of `args`, for a launch's parameters.
fn arg_pointers(args: &[u64]) -> Result<[*mut c_void; MAX_ARGS]> {
    if args.len() > MAX_ARGS {
        return Err(Error::InvalidArgument(format!(
            "{} kernel arguments; a graph passes at most {MAX_ARGS}",
            args.len()
        )));
    }
    let mut ptrs = [std::ptr::null_mut(); MAX_ARGS];
    for (p, a) in ptrs.iter_mut().zip(args) {
        *p = (a as *const u64).cast_mut().cast();
    }
    Ok(ptrs)
}

impl KernelGraph {
    /// The graph of `f`, a function of `ctx` that takes `args` 8-byte parameters, launched in
    /// blocks of `block` threads.
    pub(crate) fn new(ctx: &Arc<CudaContext>, f: &CudaFunction, block: u32, args: usize) -> Result<KernelGraph> {
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        // The node is made with zero arguments, never launched as such: each launch sets its own.
        let zeros = vec![0u64; args];
        let mut ptrs = arg_pointers(&zeros)?;
        let first = params(f.cu_function(), 1, block, &mut ptrs);
        // SAFETY: the context is bound (above).
        let graph = unsafe { graph_create() }?;
        // SAFETY: the graph is live; `first` names `f`, a function of the bound context, with
        // `args` zeros for its `args` 8-byte parameters (caller); the graph is instantiated whole.
        let made = unsafe { graph_add_kernel_node(graph, &first) }
            .and_then(|node| Ok((node, unsafe { graph_instantiate(graph) }?)));
        match made {
            Ok((node, exec)) => Ok(KernelGraph {
                ctx: ctx.clone(),
                function: f.clone(),
                graph,
                exec,
                node,
                block,
            }),
            Err(e) => {
                // SAFETY: made above, not used again.
                let _ = unsafe { graph_destroy(graph) };
                Err(e)
            }
        }
    }

    /// The device ordinal of the graph's context.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Launches the kernel on `stream` (of the graph's context) on `grid` blocks with `args`, as
    /// [`launch`](super::nvrtc::launch) does through `cuLaunchKernel`.
    ///
    /// # Safety
    /// `args` are exactly the kernel's parameters, the pointers live device allocations of the
    /// graph's device (or mapped pinned memory) kept alive until the launch is done, and the sizes
    /// bound every access the kernel makes.
    pub(crate) unsafe fn launch(&mut self, stream: &Arc<CudaStream>, grid: u64, args: &[u64]) -> Result<()> {
        let grid = u32::try_from(grid).map_err(|_| Error::InvalidArgument(format!("grid of {grid} blocks")))?;
        self.ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        let mut ptrs = arg_pointers(args)?;
        let next = params(self.function.cu_function(), grid, self.block, &mut ptrs);
        // SAFETY: `exec` was instantiated from the graph of `node`, whose function `next` names;
        // `ptrs` point at `args`, which live through the call, and match the kernel (caller).
        unsafe { graph_exec_kernel_node_set_params(self.exec, self.node, &next) }?;
        // SAFETY: `exec` is live and `stream` a stream of its context (caller), which is bound.
        unsafe { graph_launch(self.exec, stream.cu_stream()) }
    }
}

impl Drop for KernelGraph {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: made in `new`, destroyed once here; a launch still running finishes first.
            unsafe {
                let _ = graph_exec_destroy(self.exec);
                let _ = graph_destroy(self.graph);
            }
        }
    }
}
