"""Cached decoding against the model itself: the full forward pass at every step."""

import pytest
import torch


@pytest.mark.parametrize(
    "out,batch,bias", [(65, 1, False), (50257, 2, False), (2305, 4, True), (2**19 + 1, 16, True)]
)
def test_rowwise_linear_is_the_same_product(out, batch, bias):
    import torch.nn.functional as F

    from decoderlm.generation.cpu_decode import DecodeLinear, rowwise_linear

    weight, x = torch.randn(out, 32), torch.randn(batch, 1, 32)
    b = torch.randn(out) if bias else None
    expected = F.linear(x, weight, b)
    assert torch.allclose(rowwise_linear(x, weight, b), expected, atol=1e-4, rtol=1e-5)
    layer = DecodeLinear(32, out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(b)
        assert torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-5)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # autograd: plain path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduction_linear_is_the_same_product(dtype):
    import torch.nn.functional as F

    from decoderlm.generation.cpu_decode import reduction_linear

    weight, x, bias = (
        t.to(dtype) for t in (torch.randn(300, 64), torch.randn(2, 1, 64), torch.randn(300))
    )
    y = reduction_linear(x, weight, bias)
    assert y.dtype == dtype and y.shape == (2, 1, 300)
    exact = F.linear(x.double(), weight.double(), bias.double())  # of the rounded inputs
    # no less exact than F.linear in the same dtype (bfloat16 keeps 8 bits of mantissa)
    tolerance = max(1e-4, 2 * (F.linear(x, weight, bias).double() - exact).abs().max().item())
    assert (y.double() - exact).abs().max() <= tolerance


@pytest.mark.parametrize("native", [False, True])
def test_a_bfloat16_prompt_is_multiplied_in_the_cpus_prompt_dtype(monkeypatch, native):
    """A prompt's bfloat16 (and int8) products run in bfloat16 only on a CPU that multiplies
    it natively; elsewhere in float32, the weights converted for the pass. One-row products
    (decoding) stay in bfloat16."""
    import torch.nn.functional as F

    from decoderlm.generation import cpu_decode
    from decoderlm.generation.precision import Int8Linear

    monkeypatch.setattr(cpu_decode, "native_bfloat16", lambda: native)
    seen, linear = [], F.linear

    def spy(x, weight, bias=None):
        seen.append((x.dtype, weight.dtype))
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    dtype = torch.bfloat16 if native else torch.float32
    assert cpu_decode.prompt_dtype() == dtype
    layer = cpu_decode.DecodeLinear(64, 48, dtype=torch.bfloat16)
    int8 = Int8Linear(torch.nn.Linear(64, 48, bias=False), torch.bfloat16)
    prompt, one = torch.randn(1, 16, 64).bfloat16(), torch.randn(1, 1, 64).bfloat16()
    with torch.no_grad():
        outputs = [layer(prompt), int8(prompt), layer(one)]
    assert seen == [(dtype, dtype), (dtype, dtype), (torch.bfloat16, torch.bfloat16)]
    assert all(y.dtype == torch.bfloat16 for y in outputs)
    w, b = layer.weight.double(), layer.bias.double()
    exact = F.linear(prompt.double(), w, b)  # of the rounded inputs
    assert torch.allclose(outputs[0].double(), exact, atol=0.02, rtol=0.01)
    dequantised = int8.weight.double() * int8.scales.double()[:, None]
    exact = F.linear(prompt.double(), dequantised)
    assert torch.allclose(outputs[1].double(), exact, atol=0.02, rtol=0.01)


def _through(layer, x, kernel):
    """(layer(x), kernel on the layer's weights, F.linear on them), without autograd."""
    import torch.nn.functional as F

    with torch.no_grad():
        args = (x, layer.weight, layer.bias)
        return layer(x), kernel(*args), F.linear(*args)


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_one_row_float32_products_take_the_kernel_this_cpu_reads_fastest(monkeypatch, vendor):
    # the two-way split where `rowwise_wins_here` (AMD CPUs), F.linear itself on Intel's
    # (where MKL reads a one-row product at the memory's rate): bit for bit the one or the
    # other, for a block-sized weight and one row

    from decoderlm.generation import cpu_decode

    monkeypatch.setattr(cpu_decode, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_decode, "onednn_wins_here", lambda: vendor == "AuthenticAMD")
    rowwise = vendor == "AuthenticAMD"
    layer, x = cpu_decode.DecodeLinear(768, 2304), torch.randn(1, 1, 768)
    got, rowwise_y, plain = _through(layer, x, cpu_decode.rowwise_linear)
    assert not torch.equal(rowwise_y, plain)  # the two kernels' sums are told apart
    assert torch.equal(got, rowwise_y if rowwise else plain)


@pytest.mark.parametrize("onednn", [True, False])
def test_many_row_float32_products_take_onednn_where_it_wins(monkeypatch, onednn):
    # a prompt's (or a batch's) float32 products of a block-sized weight: oneDNN's kernel on
    # the weight as stored where `onednn_wins_here` (AMD CPUs, where MKL's runs at about half
    # its speed), MKL's F.linear elsewhere; bit for bit the one or the other, through
    # DecodeLinear and through an int8 layer's many-row product in float32 (an AVX2 CPU's)
    import torch.nn.functional as F

    from decoderlm.generation import cpu_decode
    from decoderlm.generation.precision import Int8Linear, dequantised_product

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_decode, "onednn_wins_here", lambda: onednn)
    monkeypatch.setattr(cpu_decode, "native_bfloat16", lambda: False)  # int8 prompt in float32
    layer, x = cpu_decode.DecodeLinear(768, 2304), torch.randn(2, 16, 768)
    got, by_onednn, plain = _through(layer, x, cpu_decode.onednn_linear)
    with torch.no_grad():
        int8 = Int8Linear(layer, torch.float32)
        w = int8.weight.float()
        got_int8 = dequantised_product(x.reshape(-1, 768), int8.weight, int8.scales)
        scales = int8.scales.float()
    assert by_onednn.shape == (2, 16, 2304)
    assert torch.allclose(by_onednn, plain, atol=1e-4, rtol=1e-4)
    assert not torch.equal(by_onednn, plain)  # the two kernels' sums are told apart
    assert torch.equal(got, by_onednn if onednn else plain)
    kernel = cpu_decode.onednn_linear if onednn else F.linear
    assert torch.equal(got_int8, kernel(x.reshape(-1, 768), w) * scales)
    # small weights (under 2^18 elements) stay F.linear: oneDNN's call costs more there
    small = cpu_decode.DecodeLinear(128, 384)
    with torch.no_grad():
        assert torch.equal(small(x[..., :128]), F.linear(x[..., :128], small.weight, small.bias))


def test_a_compiled_models_float32_prompt_reads_a_packed_copy_bit_for_bit(monkeypatch):
    # install(pack_float32=True) (a model whose step is compiled): float32 products of more
    # than 4 rows go through oneDNN's packed copy of the weight where oneDNN wins, the same
    # sums as its product on the weight as stored, so a prompt's logits do not change; one or
    # a few rows (decoding) keep their own kernel, and the state dict never sees the copy
    from decoderlm.generation import cpu_decode

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_decode, "onednn_wins_here", lambda: True)
    monkeypatch.setattr(cpu_decode, "rowwise_wins_here", lambda: True)
    layer = cpu_decode.DecodeLinear(768, 2304)
    model = cpu_decode.install(torch.nn.Sequential(layer), pack_float32=True)
    assert layer.packs_float32 and cpu_decode.DecodeLinear.packs_float32 is False
    x = torch.randn(2, 16, 768)
    with torch.no_grad():
        got = model(x)
        assert layer in cpu_decode._packed  # the copy was made, outside the module
        assert torch.equal(got, cpu_decode.onednn_linear(x, layer.weight, layer.bias))
        one = x[:1, :1]
        assert layer(one).equal(cpu_decode.rowwise_linear(one, layer.weight, layer.bias))
        layer.weight.mul_(3)  # changed in place: packed again, never stale
        assert torch.equal(layer(x), cpu_decode.onednn_linear(x, layer.weight, layer.bias))
    assert set(layer.state_dict()) == {"weight", "bias"}
    with torch.inference_mode():  # its tensors have no version counter: packed, never kept
        made = cpu_decode.DecodeLinear(768, 2304)
        cpu_decode.install(made, pack_float32=True)
        assert torch.equal(made(x), cpu_decode.onednn_linear(x, made.weight, made.bias))
        assert made not in cpu_decode._packed


@pytest.mark.parametrize("onednn", [True, False])
def test_without_native_bfloat16_a_compiled_models_prompt_reads_a_float32_copy(monkeypatch, onednn):
    # on an AMD CPU without native bfloat16 (AVX2), a compiled model's bfloat16 prompts are
    # multiplied in float32 from a packed float32 copy of each block-sized weight, made at
    # the first prompt: bit for bit the sums of converting the weight to float32 at every
    # prompt (what an eagerly decoded model does); a weight under 2^18 elements, an int8 one
    # (cheap to convert, four times its bytes as a copy), and any weight where oneDNN does
    # not win (Intel's CPUs, MKL's product) keep being converted
    from decoderlm.generation import cpu_decode
    from decoderlm.generation.precision import Int8Linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_decode, "native_bfloat16", lambda: False)
    monkeypatch.setattr(cpu_decode, "onednn_wins_here", lambda: onednn)
    layer = cpu_decode.DecodeLinear(768, 2304, dtype=torch.bfloat16)
    int8 = Int8Linear(torch.nn.Linear(768, 2304), torch.bfloat16)
    small = cpu_decode.DecodeLinear(256, 256, dtype=torch.bfloat16)  # 2^16 elements
    x = torch.randn(2, 16, 768, dtype=torch.bfloat16)
    with torch.no_grad():
        converted = [layer(x), int8(x), small(x[..., :256])]
        assert not {layer, int8, small} & set(cpu_decode._packed)
        layer.packs_float32 = small.packs_float32 = int8.packs_prompts = True
        copied = [layer(x), int8(x), small(x[..., :256])]
    for layer_of, held in [(layer, onednn), (int8, False), (small, False)]:
        assert (layer_of in cpu_decode._packed) == held
        if held:
            assert cpu_decode._packed[layer_of][1][1] == torch.float32
    for before, after in zip(converted, copied, strict=True):
        assert after.dtype == torch.bfloat16 and torch.equal(before, after)


def test_onednn_is_chosen_on_amd_cpus_only(monkeypatch):
    from decoderlm.generation import cpu_decode

    for vendor, expected in [("AuthenticAMD", True), ("GenuineIntel", False), (None, False)]:
        monkeypatch.setattr(cpu_decode, "cpu_vendor", lambda v=vendor: v)
        cpu_decode.onednn_wins_here.cache_clear()
        assert cpu_decode.onednn_wins_here() == (expected and torch.backends.mkldnn.is_available())
        assert cpu_decode.rowwise_wins_here() == (vendor != "GenuineIntel")
    cpu_decode.onednn_wins_here.cache_clear()


def test_eager_bfloat16_products_read_a_packed_copy_that_follows_the_weight():
    # where bfloat16 is native, a DecodeLinear's eager bfloat16 products (a compiled model's
    # prompt) read oneDNN's packed copy of the weight, made once: the same product as F.linear
    # for one row and for a prompt's 16, kept outside the module (state dict and deepcopy as
    # before), and made again when the weight changes in place or is replaced, never stale
    import copy

    import torch.nn.functional as F

    from decoderlm.generation import cpu_decode

    if not cpu_decode.native_bfloat16():
        pytest.skip("this CPU has no native bfloat16 products")
    layer = cpu_decode.DecodeLinear(576, 960, dtype=torch.bfloat16)  # above PACKED_MIN_WEIGHT
    x = torch.randn(1, 16, 576, dtype=torch.bfloat16)

    def exact(inputs):
        w, b = layer.weight.double(), layer.bias.double()
        return F.linear(inputs.double(), w, b)

    with torch.no_grad():
        for rows in (x[:, :1], x):
            y = layer(rows)
            assert y.dtype == torch.bfloat16 and y.shape == (*rows.shape[:-1], 960)
            assert torch.allclose(y.double(), exact(rows), atol=0.05, rtol=0.02)
        packed = cpu_decode._packed[layer][-1]
        assert layer(x).equal(cpu_decode.packed_product(x, packed, layer.bias))
        assert set(layer.state_dict()) == {"weight", "bias"}
        assert copy.deepcopy(layer)(x).equal(layer(x))
        layer.weight.mul_(-2)  # in place: the version counter moves
        assert torch.allclose(layer(x).double(), exact(x), atol=0.1, rtol=0.02)
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight), requires_grad=False)
        assert torch.allclose(layer(x).double(), exact(x), atol=0.1, rtol=0.02)
    assert layer.weight.numel() >= cpu_decode.PACKED_MIN_WEIGHT
