"""Figures as PNG images light enough to be saved in a chapter."""
import io


def png(fig):
    """A matplotlib figure as a PNG of 64 colours: it looks the same and is about a third
    of the bytes, so a chapter's saved outputs stay light (all colours without Pillow)."""
    buf = io.BytesIO()
    fig.savefig(buf, format='png')
    try:
        from PIL import Image
    except ImportError:
        return buf.getvalue()
    image = Image.open(buf).convert('RGB').quantize(64, method=Image.Quantize.MEDIANCUT)
    small = io.BytesIO()
    image.save(small, format='PNG', optimize=True)
    return small.getvalue()
