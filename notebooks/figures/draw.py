"""Draw the chapters' diagrams as SVG files next to this script.

    python notebooks/figures/draw.py          # or: make figures
    python notebooks/figures/draw.py --check  # exit 1 if a committed SVG differs

The diagrams are hand-written SVG: boxes, arrows and text, no fonts fetched, no
dates, so that the same script writes the same bytes on any machine (the unit tests
redraw them and compare). The chapters embed them as ``![caption](figures/NAME.svg)``
with a ``:label:`fig_NAME``` line; ``make book`` numbers and captions them.

The notation is the chapters' (multi_machine_training.ipynb): m workers, n servers,
M the model's bytes, N the ring's size (N = m).
"""
import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FONT = 'DejaVu Sans, Verdana, Helvetica, Arial, sans-serif'
GRAD, WEIGHT, DARK, GRAY = '#d9622b', '#2f6db5', '#333333', '#999999'
RANKS = ['#4c72b0', '#dd8452', '#55a868', '#c44e52']   # worker r's colour (ring), shard j's
PALE = '#eeeeee'


def num(v):
    """A coordinate as short, stable text."""
    return f'{round(v, 1):g}'


def esc(s):
    return s.replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')


class SVG:
    """Just enough SVG: rectangles, circles, lines and paths with arrowheads, text."""

    def __init__(self, width, height, title):
        self.width, self.height, self.title = width, height, title
        self.items, self.markers = [], {}

    def rect(self, x, y, w, h, fill='white', stroke=DARK, rx=4, sw=1.2):
        self.items.append(f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" '
                          f'rx="{rx}" fill="{fill}" stroke="{stroke}" stroke-width="{sw}"/>')

    def circle(self, cx, cy, r, fill='white', stroke=DARK, sw=1.2):
        self.items.append(f'<circle cx="{num(cx)}" cy="{num(cy)}" r="{num(r)}" fill="{fill}" '
                          f'stroke="{stroke}" stroke-width="{sw}"/>')

    def text(self, x, y, s, size=13, anchor='middle', fill=DARK, weight=None, italic=False):
        style = (f' font-weight="{weight}"' if weight else '') + \
                (' font-style="italic"' if italic else '')
        self.items.append(f'<text x="{num(x)}" y="{num(y)}" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{fill}"{style}>{esc(s)}</text>')

    def _marker(self, color):
        name = 'arrow' + color.lstrip('#')
        self.markers[name] = color
        return f'url(#{name})'

    def line(self, x1, y1, x2, y2, color=DARK, sw=1.6, end=True, start=False, dash=None):
        self.path(f'M{num(x1)},{num(y1)} L{num(x2)},{num(y2)}', color, sw, end, start, dash)

    def path(self, d, color=DARK, sw=1.6, end=True, start=False, dash=None):
        attrs = f' marker-end="{self._marker(color)}"' if end else ''
        attrs += f' marker-start="{self._marker(color)}"' if start else ''
        attrs += f' stroke-dasharray="{dash}"' if dash else ''
        self.items.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{sw}"{attrs}/>')

    def step(self, x, y, k):
        """A step's number in a circle."""
        self.circle(x, y, 9, fill='white', stroke=DARK, sw=1.2)
        self.text(x, y + 4.5, str(k), size=12, weight='bold')

    def render(self):
        defs = ''.join(
            f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            f'fill="{color}"/></marker>' for name, color in sorted(self.markers.items()))
        body = '\n'.join(self.items)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
                f'height="{self.height}" viewBox="0 0 {self.width} {self.height}" '
                f'font-family="{FONT}">\n<title>{esc(self.title)}</title>\n<defs>{defs}</defs>\n'
                f'<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n')


def legend(svg, x, y, items):
    """Coloured arrows and what they carry."""
    for color, label in items:
        svg.line(x, y, x + 34, y, color, sw=2)
        svg.text(x + 42, y + 4.5, label, size=12, anchor='start')
        x += 60 + 7 * len(label)


# -- the seven steps: 2 machines x 2 devices and the parameter servers --------------------
def seven_steps():
    svg = SVG(1000, 470, 'The seven steps of one training step on 2 machines with 2 devices each')
    sx, sy, sw, sh = 270, 18, 220, 58                      # the parameter server(s)
    svg.rect(sx, sy, sw, sh, fill='#f3f0e6')
    svg.text(sx + sw / 2, sy + 24, 'parameter server(s)', size=14, weight='bold')
    svg.text(sx + sw / 2, sy + 44, 'sum the pushes, update the weights', size=11)
    for i, mx in enumerate((20, 420)):
        svg.rect(mx, 130, 340, 300, fill='#fafafa', stroke=GRAY)
        svg.text(mx + 330, 423, f'machine {i} (worker {i})', size=12, anchor='end', fill='#555555')
        cx = mx + 110                                      # the CPU: x in cx .. cx + 120
        svg.rect(cx, 165, 120, 40, fill='white')
        svg.text(cx + 60, 190, 'CPU', size=13, weight='bold')
        devices = [(mx + 30, 285), (mx + 200, 285)]        # device boxes, 110 x 44
        for d, (dx, dy) in enumerate(devices):
            svg.rect(dx, dy, 110, 44, fill='#e8f0e8')
            svg.text(dx + 55, dy + 27, f'device {d}', size=13, weight='bold')
            # step 1: the device's half of the machine's batch, forward and backward
            svg.rect(dx + 15, 385, 80, 22, fill=PALE, stroke=GRAY, rx=2)
            svg.text(dx + 55, 400, f'batch, half {d}', size=11)
            svg.line(dx + 55, 385, dx + 55, dy + 46, DARK)
            svg.step(dx + 75, 360, 1)
        (d0x, d0y), (d1x, _) = devices
        # 2: device 1's gradients to device 0; 7: device 0's weights to device 1
        svg.line(d1x, d0y + 14, d0x + 112, d0y + 14, GRAD)
        svg.step((d0x + 110 + d1x) / 2, d0y - 2, 2)
        svg.line(d0x + 110, d0y + 32, d1x - 2, d0y + 32, WEIGHT)
        svg.step((d0x + 110 + d1x) / 2, d0y + 50, 7)
        # 3: device 0 to the CPU; 6: the CPU to device 0
        svg.line(cx + 10, d0y, cx + 10, 207, GRAD)
        svg.step(cx - 4, 245, 3)
        svg.line(cx + 26, 205, cx + 26, d0y - 2, WEIGHT)
        svg.step(cx + 40, 245, 6)
        # 4: push to the servers; 5: pull the new weights
        up, down = (sx + 40, sx + 70) if i == 0 else (sx + sw - 70, sx + sw - 40)
        svg.line(cx + 45, 165, up, sy + sh + 2, GRAD)
        svg.line(down, sy + sh, cx + 75, 163, WEIGHT)
        svg.step((cx + 45 + up) / 2 - 24, (165 + sy + sh) / 2, 4)
        svg.step((cx + 75 + down) / 2 + 24, (165 + sy + sh) / 2, 5)
    legend(svg, 20, 455, [(GRAD, 'gradients'), (WEIGHT, 'weights'), (DARK, 'data')])
    steps = ['each device computes the', 'gradients of its slice',
             'sum them on device 0', 'copy the sum to the CPU',
             'push it to the server(s),', 'which sum all machines\'',
             'update; pull the new', 'weights to every CPU',
             'copy them to device 0 ...', '... and to all devices']
    numbers = {0: 1, 2: 2, 3: 3, 4: 4, 6: 5, 8: 6, 9: 7}
    y = 150
    for j, line in enumerate(steps):
        if j in numbers:
            svg.step(788, y - 4, numbers[j])
            y += 6 if j else 0
        svg.text(805, y, line, size=12, anchor='start')
        y += 22
    svg.text(775, 130, 'one step of training', size=13, anchor='start', weight='bold')
    return svg


# -- one server against n servers ----------------------------------------------------------
def servers():
    m = 4
    svg = SVG(1000, 400, 'One parameter server against n servers: who sends what to whom')
    for panel, (x0, n) in enumerate(((0, 1), (500, 4))):
        title = 'one server (n = 1)' if n == 1 else f'n = {n} servers'
        svg.text(x0 + 250, 24, title, size=15, weight='bold')
        # servers on top, each holding a 1/n shard of the model
        sw = 150 if n == 1 else 96
        gap = (440 - n * sw) / max(n - 1, 1) if n > 1 else 0
        servers_x = [x0 + 250 - sw / 2] if n == 1 else [x0 + 30 + j * (sw + gap) for j in range(n)]
        for j, x in enumerate(servers_x):
            svg.rect(x, 85, sw, 50, fill='#f3f0e6')
            svg.text(x + sw / 2, 104, 'server' if n == 1 else f'server {j}', size=13, weight='bold')
            if n == 1:
                for k in range(m):
                    svg.rect(x + 23 + 26 * k, 112, 26, 12, fill=RANKS[k], stroke='white', rx=1, sw=1)
            else:
                svg.rect(x + sw / 2 - 13, 112, 26, 12, fill=RANKS[j], stroke='white', rx=1, sw=1)
        # workers below, each holding the whole model: n shards
        workers_x = [x0 + 30 + k * 114 for k in range(m)]
        for k, x in enumerate(workers_x):
            svg.rect(x, 250, 98, 56, fill='#e8f0e8')
            svg.text(x + 49, 270, f'worker {k}', size=13, weight='bold')
            for j in range(m):
                svg.rect(x + 10 + 19.5 * j, 282, 19.5, 12, fill=RANKS[j], stroke='white', rx=1, sw=1)
        # the links: every worker talks to every server, about its shard
        for k, wx in enumerate(workers_x):
            for j, x in enumerate(servers_x):
                color = DARK if n == 1 else RANKS[j]
                a = wx + 49 + (j - (n - 1) / 2) * 14
                b = x + sw / 2 + (k - (m - 1) / 2) * (28 if n == 1 else 12)
                svg.line(a, 248, b, 137, color, sw=1.4, start=True)
        # what crosses the links per step
        if n == 1:
            svg.text(x0 + 250, 50, 'the server\'s link: mM = 4M in, mM = 4M out per step', size=12)
            svg.text(x0 + 250, 70, 'grows as O(m)', size=12, weight='bold')
        else:
            svg.text(x0 + 250, 50, 'each server\'s link: mM/n = M in, M out per step', size=12)
            svg.text(x0 + 250, 70, 'grows as O(m/n)', size=12, weight='bold')
        svg.text(x0 + 250, 332, 'each worker\'s link: M out (gradients), M in (weights)', size=12)
        svg.text(x0 + 250, 352, 'in one piece' if n == 1 else 'in n pieces of M/n, one per server',
                 size=12, fill='#555555')
    svg.line(500, 40, 500, 360, GRAY, sw=1, end=False, dash='4,4')
    svg.text(500, 388, f'm = {m} workers; a model of M bytes in n shards (colours); '
             'each line carries its shard both ways', size=12, fill='#555555')
    return svg


# -- the ring: reduce-scatter and all-gather -------------------------------------------------
def ring_states(N):
    """Per step: (phase, step, who holds whose contributions, segment each worker sent).
    The indexing of ring_scratch.py: in reduce-scatter step s worker r sends segment
    r - s and adds segment r - s - 1; in all-gather step s it sends r + 1 - s and copies
    segment r - s."""
    held = [[{r} for _ in range(N)] for r in range(N)]    # held[r][j]: contributors
    states = [('start', 0, [[set(h) for h in row] for row in held], None)]
    for phase in ('reduce-scatter', 'all-gather'):
        for s in range(N - 1):
            send = [(r - s) % N if phase == 'reduce-scatter' else (r - s + 1) % N for r in range(N)]
            before = [[set(h) for h in row] for row in held]
            for r in range(N):
                j, left = send[(r - 1) % N], (r - 1) % N
                held[r][j] = before[r][j] | before[left][j] if phase == 'reduce-scatter' \
                    else set(before[left][j])
            states.append((phase, s, [[set(h) for h in row] for row in held], send))
    return states


def ring(N=4):
    states = ring_states(N)
    bw, bh, gx, gy = 34, 16, 5, 17                        # a segment's box and the gaps
    pw, ph = N * (bw + gx) + 40, N * (bh + gy) + 46       # a panel
    left, top = 92, 46
    per_row = N                                           # start + N-1 steps, then N-1 steps
    svg = SVG(left + per_row * pw + 10, top + 2 * ph + 80,
              f'Ring all-reduce of N = {N} workers: reduce-scatter, then all-gather')
    for i, (phase, s, held, send) in enumerate(states):
        row, col = (0, i) if i < N else (1, i - N + 1)
        x0, y0 = left + col * pw, top + row * (ph + 30)
        title = 'start' if send is None else f'{phase}, step {s + 1}'
        svg.text(x0 + (pw - 40) / 2, y0 - 8, title, size=12, weight='bold' if send is None else None)
        for r in range(N):
            y = y0 + r * (bh + gy) + 10
            if col == 0 or (row == 1 and col == 1):
                svg.text(x0 - 10, y + 12, f'worker {r}', size=12, anchor='end', fill=RANKS[r],
                         weight='bold')
            for j in range(N):
                x = x0 + j * (bw + gx)
                svg.rect(x, y, bw, bh, fill='white', stroke=GRAY, rx=1, sw=0.8)
                stripe = bw / N
                for c in sorted(held[r][j]):              # one stripe per contributor
                    svg.rect(x + c * stripe, y, stripe, bh, fill=RANKS[c], stroke='none', rx=0, sw=0)
                if len(held[r][j]) == N:
                    svg.rect(x, y, bw, bh, fill='none', stroke=DARK, rx=1, sw=1.6)
            if send is not None:                          # what worker r sent in this step
                j = send[r]
                x = x0 + j * (bw + gx) + bw / 2
                if r < N - 1:
                    svg.line(x, y + bh + 1, x, y + bh + gy - 1, DARK, sw=1.4)
                else:                                     # round the ring: to worker 0
                    svg.line(x, y + bh + 1, x, y + bh + 12, DARK, sw=1.4)
                    svg.text(x, y + bh + 24, 'to 0', size=10)
                    svg.line(x, y0 + 10 - 12, x, y0 + 9, DARK, sw=1.4)
        if send is None:
            svg.text(x0 + (pw - 40) / 2, y0 + N * (bh + gy) + 22,
                     'segments 0 .. N-1', size=11, fill='#555555')
    x, y = 12, top + ph + 48                              # under 'start': what follows
    for k, line in enumerate(['After N-1 = %d steps' % (N - 1), 'worker r holds the',
                              'complete sum of', 'segment r+1 (framed);', 'N-1 more steps',
                              'copy it round.']):
        svg.text(x, y + 18 * k, line, size=12, anchor='start', fill='#555555')
    y = top + 2 * ph + 44
    svg.text(12, y, 'Each box is one segment (M/N bytes) of a worker\'s vector; its stripes show '
             'whose numbers it holds, in the workers\' colours.', size=12, anchor='start')
    svg.text(12, y + 20, f'In every step every worker sends one segment to its right neighbour '
             f'(arrows): 2(N-1) = {2 * (N - 1)} steps of M/N bytes, 2(N-1)M/N per worker.',
             size=12, anchor='start')
    return svg


# -- data, model and pipeline parallelism ------------------------------------------------------
def parallelism():
    svg = SVG(1000, 400, 'Data, model and pipeline parallelism of a network of four layers '
              'on two devices')
    layers, lw, lh = 4, 96, 26                            # a layer's box
    panels = [('data parallelism', 'each device: the whole model,', 'its own part of the batch'),
              ('model parallelism', 'each device: part of every layer,', 'the whole batch'),
              ('pipeline parallelism', 'each device: some of the layers,', 'micro-batches in turn')]
    for k, (title, line1, line2) in enumerate(panels):
        x0 = 20 + k * 330
        svg.text(x0 + 145, 26, title, size=15, weight='bold')
        for d in range(2):                                # the two devices
            dx = x0 + 5 + d * 160
            svg.rect(dx, 44, 120, 206, fill='#fafafa', stroke=GRAY)
            svg.text(dx + 60, 64, f'device {d}', size=13, weight='bold')
            for i in range(layers):                       # layer 4 on top, layer 1 at the bottom
                y = 196 - i * 34
                if k == 0:                                # a whole copy of every layer
                    svg.rect(dx + 12, y, lw, lh, fill='#e8f0e8')
                    svg.text(dx + 60, y + 18, f'layer {i + 1}', size=12)
                elif k == 1:                              # half of every layer
                    half = 'left' if d == 0 else 'right'
                    svg.rect(dx + 12, y, lw, lh, fill='white', stroke=GRAY, sw=0.8)
                    svg.rect(dx + 12 + d * lw / 2, y, lw / 2, lh, fill='#e8f0e8')
                    svg.text(dx + 60, y + 18, f'{half} half of {i + 1}', size=11)
                elif (i < 2) == (d == 0):                 # layers 1-2 on device 0, 3-4 on 1
                    svg.rect(dx + 12, y, lw, lh, fill='#e8f0e8')
                    svg.text(dx + 60, y + 18, f'layer {i + 1}', size=12)
            if k < 2:                                     # the data each device reads
                words = f'batch, half {d}' if k == 0 else 'the whole batch'
                svg.rect(dx + 12, 272, lw, 22, fill=PALE, stroke=GRAY, rx=2)
                svg.text(dx + 60, 287, words, size=11)
                svg.line(dx + 60, 272, dx + 60, 224, DARK)
        if k == 0:                                        # the gradients are summed
            svg.line(x0 + 128, 120, x0 + 172, 120, GRAD, start=True)
            svg.text(x0 + 150, 112, 'sum', size=11, fill=GRAD)
        elif k == 1:                                      # activations at every layer
            for i in range(layers):
                y = 196 - i * 34 + 13
                svg.line(x0 + 115, y, x0 + 175, y, DARK, sw=1.2, start=True)
        else:                                             # layer 2's output goes to layer 3
            svg.path(f'M{x0 + 110},{160} C{x0 + 150},{160} {x0 + 140},{126} {x0 + 175},{126}', DARK)
            svg.path(f'M{x0 + 175},{138} C{x0 + 140},{138} {x0 + 150},{172} {x0 + 112},{172}', GRAD,
                     sw=1.2)
            for j in range(3):                            # micro-batches 1, 2, 3 for device 0
                svg.rect(x0 + 17 + j * 33, 272, 30, 22, fill=PALE, stroke=GRAY, rx=2)
                svg.text(x0 + 32 + j * 33, 287, f'{j + 1}', size=11)
            svg.line(x0 + 65, 272, x0 + 65, 224, DARK)
            svg.text(x0 + 225, 287, 'micro-batches', size=11, fill='#555555')
        svg.text(x0 + 145, 322, line1, size=12)
        svg.text(x0 + 145, 340, line2, size=12)
    for x in (340, 670):
        svg.line(x, 40, x, 345, GRAY, sw=1, end=False, dash='4,4')
    legend(svg, 20, 378, [(GRAD, 'gradients'), (DARK, 'data, activations')])
    svg.text(980, 382, 'this book: data parallelism, over many machines', size=12, anchor='end',
             weight='bold')
    return svg


# -- hierarchical all-reduce: inside each machine, then across ----------------------------------
def hierarchical(h=3, g=4):
    svg = SVG(1000, 390, f'Hierarchical all-reduce of h = {h} machines with G = {g} GPUs each')
    mw, gw, gh = 300, 56, 40                              # a machine's width, a GPU's box
    leaders = []
    for i in range(h):
        mx = 20 + i * (mw + 30)
        svg.rect(mx, 120, mw, 170, fill='#fafafa', stroke=GRAY)
        svg.text(mx + mw - 10, 282, f'machine {i}', size=12, anchor='end', fill='#555555')
        xs = [mx + 18 + j * (gw + 16) for j in range(g)]
        for j, x in enumerate(xs):
            svg.rect(x, 180, gw, gh, fill='#e8f0e8' if j else '#cfe3cf', sw=1.6 if j == 0 else 1.2)
            svg.text(x + gw / 2, 205, f'GPU {j}', size=12, weight='bold' if j == 0 else None)
        for j in range(1, g):                             # 1: reduce onto GPU 0, a chain
            svg.line(xs[j], 188, xs[j - 1] + gw + 2, 188, GRAD)
            svg.line(xs[j - 1] + gw, 212, xs[j] - 2, 212, WEIGHT)   # 3: broadcast from GPU 0
        svg.step((xs[1] + xs[0] + gw) / 2, 166, 1)
        svg.step((xs[1] + xs[0] + gw) / 2, 236, 3)
        svg.text(mx + mw / 2, 262, 'inside: NVLink, B_in', size=11, fill='#555555')
        leaders.append(xs[0] + gw / 2)
    for i in range(h):                                    # 2: the ring of the GPUs 0
        a, b = leaders[i], leaders[(i + 1) % h]
        if i < h - 1:
            svg.path(f'M{a + 8},178 C{a + 60},96 {b - 60},96 {b - 8},178', GRAD, sw=2)
        else:                                             # round the ring, over the top
            svg.path(f'M{a},178 C{a + 40},40 {b - 40},40 {b},178', GRAD, sw=2, dash='6,3')
    svg.step((leaders[0] + leaders[1]) / 2, 136, 2)
    svg.text(500, 56, 'across: the network, B_across (a ring of the GPUs 0, one per machine)',
             size=12, fill='#555555')
    lines = [(1, 'reduce: each machine sums its G gradients onto GPU 0, over its fast links'),
             (2, 'all-reduce: a ring of the h GPUs 0 sums the machines\' sums over the slow network'),
             (3, 'broadcast: GPU 0 copies the sum of every GPU to the other GPUs of its machine')]
    for k, (number, line) in enumerate(lines):
        svg.step(30, 318 + 22 * k - 4, number)
        svg.text(46, 318 + 22 * k, line, size=12, anchor='start')
    legend(svg, 720, 340, [(GRAD, 'sums'), (WEIGHT, 'the sum of all')])
    return svg


# -- ZeRO's stages: what each worker holds ------------------------------------------------------
def zero_stages(N=4):
    svg = SVG(1000, 330, f'What each of N = {N} workers holds at each stage of ZeRO, '
              'Adam in mixed precision')
    kinds = [('weights', 2, WEIGHT), ('gradients', 2, GRAD), ('optimizer state', 12, '#55a868')]
    rows = [('data parallelism', 0, '16Ψ bytes'), ('stage 1', 1, '4Ψ + 12Ψ/N'),
            ('stage 2', 2, '2Ψ + 14Ψ/N'), ('stage 3', 3, '16Ψ/N')]
    unit, cw = 9.5, 190                                   # px per byte of a parameter; a worker
    for r in range(N):
        svg.text(200 + r * cw + 76, 24, f'worker {r}', size=13, weight='bold')
    for i, (name, stage, formula) in enumerate(rows):
        y = 40 + i * 62
        svg.text(20, y + 24, name, size=13, anchor='start', weight='bold')
        sharded = {'optimizer state': stage >= 1, 'gradients': stage >= 2, 'weights': stage >= 3}
        svg.text(20, y + 42, formula, size=12, anchor='start', fill='#555555')
        for r in range(N):
            x = 200 + r * cw
            for kind, nbytes, color in kinds:
                w = nbytes * unit
                svg.rect(x, y + 8, w, 30, fill=PALE if sharded[kind] else color,
                         stroke=GRAY, rx=1, sw=0.8)
                if sharded[kind]:                          # worker r's 1/N of it
                    svg.rect(x + r * w / N, y + 8, w / N, 30, fill=color, stroke=DARK, rx=1, sw=0.8)
                x += w
    svg.text(500, 300, 'a bar per kind, its length its bytes per parameter (fp16 weights and '
             'gradients, fp32 Adam state); pale: held by the other workers', size=12)
    for k, (kind, _, color) in enumerate(kinds):
        svg.rect(250 + k * 180, 311, 14, 12, fill=color, stroke=DARK, rx=1, sw=0.8)
        svg.text(270 + k * 180, 321, kind, size=12, anchor='start')
    return svg


FIGURES = {'seven_steps': seven_steps, 'servers': servers, 'ring': ring,
           'parallelism': parallelism, 'hierarchical': hierarchical,
           'zero_stages': zero_stages}


def draw(out=HERE):
    """Write every figure into out; returns their paths."""
    paths = []
    for name, make in FIGURES.items():
        path = Path(out) / f'{name}.svg'
        path.write_text(make().render())
        paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--check', action='store_true', help='compare, write nothing')
    args = parser.parse_args(argv)
    if args.check:
        stale = [name for name, make in FIGURES.items()
                 if (HERE / f'{name}.svg').read_text() != make().render()]
        print('figures: ' + (f'redraw {", ".join(stale)} (make figures)' if stale else 'up to date'))
        return 1 if stale else 0
    for path in draw():
        print(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
