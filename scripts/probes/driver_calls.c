// What the driver calls on the small-batch paths cost the calling thread: creating, recording and
// destroying an event, a stream waiting on one, looking up the device address of mapped pinned
// memory, launching a one-thread kernel, and how long until the host sees that kernel done,
// through cuStreamSynchronize or by spinning on a flag the kernel writes into mapped pinned memory;
// and the same kernel launched as a one-node CUDA graph.
//
//   nvcc -O2 -o /tmp/driver_calls scripts/probes/driver_calls.c -lcuda && /tmp/driver_calls
#include "probe.h"

enum { N = 5000 };

static const char* PTX =
    ".version 7.0\n.target sm_52\n.address_size 64\n"
    ".visible .entry noop() { ret; }\n"
    ".visible .entry flag(.param .u64 p, .param .u32 v) {\n"
    "  .reg .u64 %rd<2>; .reg .u32 %r<2>;\n"
    "  ld.param.u64 %rd1, [p]; ld.param.u32 %r1, [v];\n"
    "  membar.sys; st.volatile.global.u32 [%rd1], %r1; ret; }\n";

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CUmodule mod;
    CUfunction noop, flag;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CUstream other;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&noop, mod, "noop"));
    CHECK(cuModuleGetFunction(&flag, mod, "flag"));
    volatile unsigned* host;
    CHECK(cuMemHostAlloc((void**)&host, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
    CUdeviceptr dptr;
    static CUevent events[N];
    for (int round = 0; round < 3; round++) {
        double t0 = micros();
        if (round) CHECK(cuEventDestroy(events[0]));
        for (int i = 0; i < N; i++) CHECK(cuEventCreate(&events[i], CU_EVENT_DISABLE_TIMING));
        double t1 = micros();
        for (int i = 0; i < N; i++) CHECK(cuEventRecord(events[i], s));
        double t2 = micros();
        for (int i = 0; i < N; i++) CHECK(cuStreamWaitEvent(s, events[i], 0));
        double t3 = micros();
        CHECK(cuStreamSynchronize(s));
        double t4 = micros();
        for (int i = 1; i < N; i++) CHECK(cuEventDestroy(events[i]));
        double t5 = micros();
        for (int i = 0; i < N; i++) CHECK(cuMemHostGetDevicePointer(&dptr, (void*)host, 0));
        double t6 = micros();
        for (int i = 0; i < N; i++) CHECK(cuCtxSetCurrent(ctx));
        double t7 = micros();
        printf("event create %.2f, record %.2f, stream wait %.2f, destroy %.2f (of N-1), host device pointer %.2f "
               "(same as host: %d), ctx set current %.2f us\n",
               (t1 - t0) / N, (t2 - t1) / N, (t3 - t2) / N, (t5 - t4) / (N - 1), (t6 - t5) / N,
               dptr == (CUdeviceptr)host, (t7 - t6) / N);
        double launch = 0, sync = 0, spin = 0, launch2 = 0;
        for (int i = 0; i < N; i++) {
            double a = micros();
            CHECK(cuLaunchKernel(noop, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
            double b = micros();
            CHECK(cuStreamSynchronize(s));
            double c = micros();
            launch += b - a;
            sync += c - b;
        }
        for (int i = 0; i < N; i++) {
            unsigned v = (unsigned)(round * N + i + 1);
            void* args[] = {&dptr, &v};
            double a = micros();
            CHECK(cuLaunchKernel(flag, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
            double b = micros();
            while (*host != v) {
            }
            double c = micros();
            launch2 += b - a;
            spin += c - b;
            CHECK(cuStreamSynchronize(s));
        }
        printf("launch %.2f then cuStreamSynchronize %.2f us; launch %.2f then spin on a mapped flag %.2f us\n",
               launch / N, sync / N, launch2 / N, spin / N);
        // The flag kernel as a one-node graph, instantiated once, its value set before each launch
        // (as an import would set the addresses it reads).
        CUDA_KERNEL_NODE_PARAMS params = {0};
        params.func = flag;
        params.gridDimX = params.gridDimY = params.gridDimZ = 1;
        params.blockDimX = params.blockDimY = params.blockDimZ = 1;
        unsigned first = 0;
        void* first_args[] = {&dptr, &first};
        params.kernelParams = first_args;
        CUgraph graph;
        CUgraphNode node;
        CUgraphExec exec;
        CHECK(cuGraphCreate(&graph, 0));
        CHECK(cuGraphAddKernelNode(&node, graph, NULL, 0, &params));
        CHECK(cuGraphInstantiate(&exec, graph, 0));
        double set = 0, graph_launch = 0, graph_spin = 0;
        for (int i = 0; i < N; i++) {
            unsigned v = (unsigned)(1000000 + round * N + i);
            void* args[] = {&dptr, &v};
            params.kernelParams = args;
            double a = micros();
            CHECK(cuGraphExecKernelNodeSetParams(exec, node, &params));
            double b = micros();
            CHECK(cuGraphLaunch(exec, s));
            double c = micros();
            while (*host != v) {
            }
            double d = micros();
            set += b - a;
            graph_launch += c - b;
            graph_spin += d - c;
            CHECK(cuStreamSynchronize(s));
        }
        printf("the flag kernel as a graph: set its value %.2f, cuGraphLaunch %.2f, then spin %.2f us\n", set / N,
               graph_launch / N, graph_spin / N);
        CHECK(cuGraphExecDestroy(exec));
        CHECK(cuGraphDestroy(graph));
        // The same, after the stream was made to wait for an event of another stream that has
        // completed (as an import waits for its producer's event).
        double waited = 0, launched = 0, synced = 0;
        for (int i = 0; i < N; i++) {
            CHECK(cuEventRecord(events[0], other));
            CHECK(cuEventSynchronize(events[0]));
            double a = micros();
            CHECK(cuStreamWaitEvent(s, events[0], 0));
            double b = micros();
            CHECK(cuLaunchKernel(noop, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
            double c = micros();
            CHECK(cuStreamSynchronize(s));
            double d = micros();
            waited += b - a;
            launched += c - b;
            synced += d - c;
        }
        printf("after waiting on another stream's completed event (%.2f us): launch %.2f then cuStreamSynchronize %.2f us\n",
               waited / N, launched / N, synced / N);
        double queried = 0;
        for (int i = 0; i < N; i++) {
            double a = micros();
            CHECK(cuEventQuery(events[0]));
            queried += micros() - a;
        }
        printf("cuEventQuery of a completed event %.2f us\n", queried / N);
    }
    return 0;
}
