"""book/prose.py: the words and sentences of a notebook's markdown, counted by hand here."""

import nbformat

from support import ROOT, load_script


prose = load_script('book/prose.py', 'book_prose')

LONG = ' '.join(['many'] * 41) + '.'     # one sentence of 41 words

MADE_UP = [
    # heading: 3 words, no sentence; the label line and the fence count nothing
    '# A Title Here\n:label:`sec_x`\n\n'
    # 9 words (math one word, 4.8 one word), then 8 (e.g. does not end it; code one word)
    'The ring sends $2(N-1)/N$ of the model, 4.8 GB. It is optimal, e.g. for large '
    '`all_reduce tensors` too!\n\n'
    '```python\nprint("not counted at all")\n```\n',
    # table: 'what bytes' and 'stage 1 4.8 MB', 6 words, no sentence; the rule row nothing
    '| what | bytes |\n| --- | --- |\n| stage 1 | 4.8 MB |\n\n'
    # items: 5 words (no full stop, still a sentence), then 2 and 3
    '* first item without a stop\n* second item. Two sentences here\n\n'
    # display math nothing; the link its text: 4 words
    '$$x = y + z$$\n\nSee [the paper](https://example.org) now. <a id="x"></a>\n\n' + LONG,
]


def made_up():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(s) for s in MADE_UP]
    nb.cells.insert(1, nbformat.v4.new_code_cell('x = 1  # code cells are not prose'))
    return nb


def test_words_and_sentences_of_a_made_up_notebook():
    total, lengths = prose.count(made_up())
    assert lengths == [9, 8, 5, 2, 3, 4, 41]
    assert total == 3 + 9 + 8 + 6 + 5 + 2 + 3 + 4 + 41 == 81


def test_a_row_against_the_targets():
    total, lengths = prose.count(made_up())
    r = prose.row('chapter', total, lengths)
    # sorted 2 3 4 5 8 9 41: the median is 5; one of 7 sentences is over 40 words
    assert r['median'] == 5 and r['median_ok']
    assert r['long'] == 1 / 7 and not r['long_ok']
    assert r['words_ok']
    assert not prose.row('chapter', 3501, lengths)['words_ok']
    assert prose.row('other', 3501, lengths)['words_ok']      # answers: no word target


def test_the_table_lists_every_notebook_once():
    names = [name for name, _, _ in prose.notebooks()]
    folder = ROOT / 'notebooks'
    assert sorted(names) == sorted([p.stem for p in folder.glob('*.ipynb')] +
                                   [f'{p.parent.name}/{p.stem}' for p in folder.glob('appendix*/*.ipynb')])
    assert names[-1] == 'answers'


def test_the_plain_count_is_every_token_of_the_markdown():
    # wc -w's count: formulas, code, fences, labels, tags and table bars are all words
    tokens = sum(len(source.split()) for source in MADE_UP)
    assert prose.plain_count(made_up()) == tokens
    assert tokens > prose.count(made_up())[0]        # stricter than the reader's count


def test_the_word_targets_hold_by_both_counts():
    _, lengths = prose.count(made_up())
    assert prose.row('chapter', 3500, lengths, 3500)['words_ok']
    assert not prose.row('chapter', 3400, lengths, 3501)['words_ok']
    assert not prose.row('chapter', 3501, lengths, 3400)['words_ok']


def test_the_book_total_is_checked_by_both_counts(tmp_path, monkeypatch):
    # two made-up chapters whose sum is over the book's target by the plain count only
    monkeypatch.setattr(prose, 'chapters_in_order', lambda: ['one', 'two'])
    monkeypatch.setattr(prose, 'CHAPTER_WORDS', 10 ** 6)
    monkeypatch.setattr(prose, 'LONG_SHARE', 1)
    nb = made_up()
    for name in ('one', 'two'):
        nbformat.write(nb, tmp_path / f'{name}.ipynb')
    words, plain = prose.count(nb)[0], prose.plain_count(nb)
    monkeypatch.setattr(prose, 'BOOK_WORDS', 2 * words)
    rows, total, ok = prose.table(tmp_path)
    assert (total['chapter_words'], total['chapter_plain']) == (2 * words, 2 * plain)
    assert not total['words_ok'] and not ok
    monkeypatch.setattr(prose, 'BOOK_WORDS', 2 * plain)
    assert prose.table(tmp_path)[2]


def test_the_book_meets_its_targets():
    # issue 50's targets on the real notebooks: a cut that ends, a section that grows, shows here
    rows, total, ok = prose.table()
    missed = [name for name, r in rows if not (r['words_ok'] and r['median_ok'] and r['long_ok'])]
    assert ok, f'prose targets missed by {missed or "the main paths total"}: run book/prose.py'
