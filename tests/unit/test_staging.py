"""runtime/staging.py: one flat tensor for a collective, without a copy when it can."""
import torch

from d2ldist.runtime.staging import staged


def test_views_back_to_back_are_their_own_flat_tensor():
    buffer = torch.zeros(10)
    views = [buffer[:4].view(2, 2), buffer[4:10]]
    with staged(views, 'cpu') as flat:
        assert flat.data_ptr() == buffer.data_ptr() and flat.shape == (10,)
        flat += 1
    assert (buffer == 1).all()
    with staged(buffer[3:5], 'cpu') as flat:                  # one tensor, no copy either
        assert flat.data_ptr() == buffer[3:].data_ptr()


def test_anything_else_is_copied_and_written_back():
    a, b = torch.zeros(2, 3).t(), torch.zeros(4)              # not contiguous; not adjacent
    with staged([a, b], 'cpu') as flat:
        assert flat.shape == (10,) and flat.is_contiguous()
        flat.copy_(torch.arange(10.))
        assert a.sum() == 0                                    # written back at the end
    assert a.tolist() == [[0., 1.], [2., 3.], [4., 5.]] and b.tolist() == [6., 7., 8., 9.]
    flags = torch.tensor([True, False])
    with staged(flags, 'cpu', torch.uint8) as flat:            # torch backend: bool as uint8
        assert flat.dtype == torch.uint8
        flat.fill_(1)
    assert flags.all()


def test_nothing_written_back_after_an_error():
    a = torch.zeros(2, 2).t()
    try:
        with staged(a, 'cpu') as flat:
            flat.fill_(5)
            raise RuntimeError('the collective failed')
    except RuntimeError:
        pass
    assert (a == 0).all()


def test_a_parameter_that_requires_grad():
    p = torch.nn.Parameter(torch.zeros(3))
    with staged([p], 'cpu') as flat:
        flat.fill_(2)
    assert (p.detach() == 2).all()
