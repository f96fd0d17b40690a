"""Gradient compression: fewer bits on the wire, and what they lose kept for later.

    codec = compression.create({'type': '2bit', 'threshold': 0.5})   # MXNet's words
    data = codec.encode(key, grad)          # what is sent: 1/16 of float32's bytes
    grad_sent = codec.decode(data, grad.numel())

Two schemes, as MXNet's kvstore and Horovod have them:

* **2-bit** (MXNet's ``kv.set_gradient_compression({'type': '2bit', 'threshold': t})``):
  each value of gradient + residual becomes +t, -t or 0, two bits, so 16 values take
  the space of one float32. The *residual* is what was not sent: it is added to the
  next gradient of the same key, so a small gradient is delayed until it adds up to
  t, never lost (error feedback, as in 1-bit SGD, Seide et al. 2014). With
  ``'error_feedback': False`` (d2ldist's switch, to show why it matters) it is lost.
* **fp16 / bf16**: each value cast to 16 bits, half the bytes. The relative error is
  at most 2^-11 for fp16 (for values between 6.1e-5 and 65504; smaller ones lose
  precision, larger ones become inf) and 2^-8 for bf16 (float32's whole range).

Only gradients are compressed; weights travel whole. The receiver decodes numbers
only: bytes that are not what ``encode`` makes raise ValueError.
"""
import torch

from ..lines import NAME, clip

PLUS, MINUS = 1, 2           # 2-bit codes; 0 is zero, 3 is never sent


def create(params):
    """The codec ``params`` names: None for no compression ('none', {} or None)."""
    if params is None or params == 'none':
        return None
    if isinstance(params, str):
        params = {'type': params}
    if not isinstance(params, dict):
        raise ValueError(clip(f'gradient compression takes a dict like {{"type": "2bit", '
                              f'"threshold": 0.5}}, got {params!r}', NAME))
    params = dict(params)
    kind = params.pop('type', 'none')
    if kind == 'none' and not params:
        return None
    try:
        if kind == '2bit':
            return TwoBit(**params)
        if kind in CASTS and not params:
            return Cast(kind)
    except TypeError:
        pass
    raise ValueError(f'unknown gradient compression {dict(params, type=kind)!r}: use '
                     "{'type': '2bit', 'threshold': T[, 'error_feedback': False]}, "
                     "{'type': 'fp16'} or {'type': 'bf16'}")


class TwoBit:
    """MXNet's 2-bit compression, with the residual kept per key (error feedback)."""

    name = '2bit'

    def __init__(self, threshold=0.5, error_feedback=True):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not threshold > 0:
            raise ValueError(f'2-bit compression needs a threshold > 0, got {threshold!r}')
        self.threshold, self.error_feedback = float(threshold), bool(error_feedback)
        self.residuals = {}      # key -> what was not sent yet

    @property
    def params(self):
        return {'type': '2bit', 'threshold': self.threshold,
                'error_feedback': self.error_feedback}

    def encode(self, key, grad):
        """The 1-D gradient ``grad`` as bytes: four values a byte, two bits each."""
        x = grad.detach().reshape(-1)
        if self.error_feedback and key in self.residuals:
            x = x + self.residuals[key]
        codes = torch.zeros(x.numel(), dtype=torch.uint8)
        codes[x >= self.threshold] = PLUS
        codes[x <= -self.threshold] = MINUS
        if self.error_feedback:                     # keep what was not sent
            self.residuals[key] = x - self._values(codes, x.dtype)
        return _pack(codes)

    def decode(self, data, numel, dtype=torch.float32):
        """What ``encode`` sent: a tensor of +threshold, -threshold and 0."""
        return self._values(_unpack(data, numel), dtype)

    def nbytes(self, numel):
        return (numel + 3) // 4

    def _values(self, codes, dtype):
        t = self.threshold
        return (codes == PLUS).to(dtype) * t - (codes == MINUS).to(dtype) * t


CASTS = {'fp16': torch.float16, 'bf16': torch.bfloat16}


class Identity:
    """No compression, in Horovod's words (``Compression.none``): the tensor as it is."""

    name = 'none'

    def compress(self, tensor):
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor


class Cast:
    """Values cast to 16 bits on the wire (fp16 or bf16).

    Two ways to use it: MXNet's kvstore sends bytes (``encode``, ``decode``); Horovod's
    and the ring's collectives reduce the 16-bit tensor itself (``compress``,
    ``decompress``: ``hvd.Compression.fp16`` is ``Cast('fp16')``)."""

    def __init__(self, name):
        self.name, self.dtype = name, CASTS[name]

    @property
    def params(self):
        return {'type': self.name}

    def encode(self, key, grad):
        return grad.detach().reshape(-1).to(self.dtype).view(torch.uint8)

    def decode(self, data, numel, dtype=torch.float32):
        raw = _bytes(data, 2 * numel)
        return raw.view(self.dtype).to(dtype)

    def nbytes(self, numel):
        return 2 * numel

    def compress(self, tensor):
        """Floating-point values in 16 bits, to reduce as they are; what to undo it."""
        if tensor.dtype.is_floating_point:
            return tensor.to(self.dtype), tensor.dtype
        return tensor, None

    def decompress(self, tensor, ctx):
        """Back in the tensor's own dtype."""
        return tensor if ctx is None else tensor.to(ctx)


def _pack(codes):
    """Four 2-bit codes a byte: code i of a group of four in bits 2i, 2i + 1."""
    pad = (-codes.numel()) % 4
    c = torch.cat([codes, codes.new_zeros(pad)]).view(-1, 4)
    return c[:, 0] | c[:, 1] << 2 | c[:, 2] << 4 | c[:, 3] << 6


def _unpack(data, numel):
    """The codes of ``numel`` values from their packed bytes."""
    b = _bytes(data, (numel + 3) // 4)
    codes = torch.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], dim=1).view(-1)[:numel]
    if (codes == 3).any():
        raise ValueError('2-bit data holds a code that is never sent (3)')
    return codes


def _bytes(data, expected):
    """Received bytes (or a uint8 tensor) as a uint8 tensor of the expected length."""
    if isinstance(data, torch.Tensor):
        raw = data
    else:                                  # (a copy: received frames are read-only)
        buf = bytearray(data)
        raw = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(
            0, dtype=torch.uint8)
    if raw.numel() != expected:
        raise ValueError(f'compressed data of {raw.numel()} bytes, expected {expected}')
    return raw
