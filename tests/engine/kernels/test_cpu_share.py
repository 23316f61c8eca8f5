"""The CPU's share of a graphed decode step (engine/kernels/cpu_share.py): CPU threads that serve the layers the
GPU posts to a mailbox in host memory. Here the GPU's side is played by reference.post_cpu_share and
reference.wait_cpu_share (and by the Triton kernels in Triton's CPU interpreter): every layer's sum must equal
the CPU expert kernel's for the same experts, layers with nothing for the CPU must pass, and a step that never
comes must end in a plain error, not a hang."""

import threading

import pytest
import torch

from engine.bench_cpu import nvfp4_records
from engine.kernels import cpu_experts, cpu_share, reference

pytestmark = pytest.mark.skipif(cpu_experts.numba is None, reason="the CPU threads are numba's")

TOP_K, HIDDEN, INTERMEDIATE = 4, 256, 128


@pytest.fixture
def make_worker():
    """CpuShareWorker(...), closed after the test whatever happens (its thread would otherwise keep spinning)."""
    made = []

    def make(*args):
        made.append(cpu_share.CpuShareWorker(*args))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


@pytest.fixture(scope="module")
def layers():
    layout, ring = nvfp4_records(count=24, hidden=HIDDEN, intermediate=INTERMEDIATE, seed=4)
    return layout, [ring[:8].clone(), ring[8:16].clone(), ring[16:].clone()]


def _serve_a_step(worker, records, post, wait, gen, gpu_share=0.5, device="cpu"):
    """One step over every layer, the GPU's side played by `post` and `wait` on `device`, each expert the GPU's
    with chance `gpu_share`; what each layer sent and got, on the CPU."""
    base = torch.tensor([worker.start(len(records))], dtype=torch.int32, device=device)
    waits = torch.zeros(2, dtype=torch.int32, device=device)
    sent = []
    for layer in range(len(records)):
        ids = torch.randperm(8, generator=gen)[:TOP_K]
        weights, y = torch.rand(TOP_K, generator=gen), torch.randn(1, HIDDEN, generator=gen)
        gpu_rows = (torch.rand(TOP_K, generator=gen) < gpu_share).float()
        if layer == 1:
            gpu_rows.fill_(1.0)  # nothing for the CPU in this layer
        routed = torch.full((1, HIDDEN), float("nan"), device=device)
        on_device = [t.to(device) for t in (ids, weights, gpu_rows, y)]
        post(*on_device, base, layer, worker.mailbox)
        wait(on_device[2], base, layer, worker.mailbox, routed, waits)
        sent.append((ids, weights, y, gpu_rows, routed.cpu()))
    computed = worker.finish()
    waits = waits.cpu()
    # the layers with CPU experts are counted, and those where the GPU found the CPU still at work among them
    assert int(waits[1]) == sum(bool((rows == 0).any()) for _, _, _, rows, _ in sent) and waits[0] <= waits[1]
    return sent, computed


@pytest.mark.parametrize("activations", ["float32", "bf16"])
@pytest.mark.parametrize("threads, gpu_share, steps", [(1, 0.5, 3), (2, 0.0, 20)])
def test_each_layer_gets_the_sum_of_its_cpu_experts(layers, activations, threads, gpu_share, steps, make_worker):
    """With two threads and every expert on the CPU, one layer's items end in both threads, and its sum must
    still hold every expert's output."""
    if activations == "bf16" and not cpu_experts.bf16_dot_supported():
        pytest.skip("this CPU has no AVX512-BF16 dot")
    if threads > cpu_experts.numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba has fewer than {threads} threads here")
    layout, records = layers
    kernel = cpu_experts.CpuExpertKernel(layout, activations)
    worker = make_worker(kernel, records, cpu_share.Mailbox(TOP_K, HIDDEN, pin=False), threads)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):  # the sequence numbers go on from step to step
        sent, computed = _serve_a_step(
            worker, records, reference.post_cpu_share, reference.wait_cpu_share, gen, gpu_share
        )
        assert computed == sum(int((rows == 0).sum()) for _, _, _, rows, _ in sent)
        for layer, (ids, weights, y, gpu_rows, routed) in enumerate(sent):
            on_cpu = (gpu_rows == 0).reshape(1, TOP_K)
            expected = kernel.run(records[layer], y, ids.reshape(1, TOP_K), weights.reshape(1, TOP_K), on_cpu)
            assert torch.allclose(routed, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
            assert bool(on_cpu.any()) or not routed.any()  # nothing for the CPU: zeros, not the last layer's sum


def test_the_triton_kernels_play_the_gpus_side(layers, make_worker):
    """The same exchange through the CUDA kernels' code (Triton's interpreter in CI)."""
    pytest.importorskip("triton", reason="Triton ships for Linux")
    from engine.kernels import triton_cpu_share

    if not torch.cuda.is_available() and not cpu_share.os.environ.get("TRITON_INTERPRET"):
        pytest.skip("no CUDA and no Triton interpreter")
    layout, records = layers
    kernel = cpu_experts.CpuExpertKernel(layout, "float32")
    worker = make_worker(kernel, records, cpu_share.Mailbox(TOP_K, HIDDEN, pin=torch.cuda.is_available()))
    sent, computed = _serve_a_step(
        worker,
        records,
        triton_cpu_share.post_cpu_share,
        triton_cpu_share.wait_cpu_share,
        torch.Generator().manual_seed(3),
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    assert computed > 0
    for layer, (ids, weights, y, gpu_rows, routed) in enumerate(sent):
        on_cpu = (gpu_rows == 0).reshape(1, TOP_K)
        expected = kernel.run(records[layer], y, ids.reshape(1, TOP_K), weights.reshape(1, TOP_K), on_cpu)
        assert torch.allclose(routed, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_a_step_the_gpu_never_posts_ends_in_a_plain_error(layers, make_worker):
    layout, records = layers
    worker = make_worker(
        cpu_experts.CpuExpertKernel(layout, "float32"), records, cpu_share.Mailbox(TOP_K, HIDDEN, pin=False)
    )
    worker.start(len(records))
    with pytest.raises(cpu_share.CpuShareError, match="did not finish within"):
        worker.finish(timeout=0.5)
    assert worker.mailbox.flags[cpu_share.CANCEL] == 1  # the GPU's waits are released too
    worker.clear_cancel()
    sent, computed = _serve_a_step(
        worker, records, reference.post_cpu_share, reference.wait_cpu_share, torch.Generator().manual_seed(1)
    )  # and the next step works
    assert computed > 0


def test_an_expert_beyond_the_records_ends_the_step_in_a_plain_error(layers, make_worker):
    layout, records = layers
    worker = make_worker(
        cpu_experts.CpuExpertKernel(layout, "float32"), records, cpu_share.Mailbox(TOP_K, HIDDEN, pin=False)
    )
    base = torch.tensor([worker.start(len(records))], dtype=torch.int32)
    routed, waits = torch.zeros(1, HIDDEN), torch.zeros(2, dtype=torch.int32)
    gpu_rows = torch.zeros(TOP_K)
    reference.post_cpu_share(
        torch.tensor([0, 1, 2, 99]), torch.rand(TOP_K), gpu_rows, torch.randn(1, HIDDEN), base, 0, worker.mailbox
    )
    reference.wait_cpu_share(gpu_rows, base, 0, worker.mailbox, routed, waits)  # released by cancel, not a hang
    with pytest.raises(cpu_share.CpuShareError, match="cancelled"):
        worker.finish(timeout=10)


def test_cancel_releases_a_gpu_wait(layers):
    """The GPU's wait ends on cancel (the host sets it when a step fails), so no step can hang the device."""
    box = cpu_share.Mailbox(TOP_K, HIDDEN, pin=False)
    routed = torch.zeros(1, HIDDEN)
    waiter = threading.Thread(
        target=reference.wait_cpu_share,
        args=(
            torch.zeros(TOP_K),
            torch.tensor([5], dtype=torch.int32),
            0,
            box,
            routed,
            torch.zeros(2, dtype=torch.int32),
        ),
    )
    waiter.start()
    box.flags[cpu_share.CANCEL] = 1
    waiter.join(timeout=10)
    assert not waiter.is_alive()
