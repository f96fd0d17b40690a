"""The chapters for readers without a clone: ``d2l-book DIR`` copies them out.

    pip install d2ldist
    d2l-book d2ldist-book            # or, in Python: d2ldist.download_chapters('d2ldist-book')
    jupyter lab d2ldist-book

d2l's readers get the book as notebooks to run, so the wheel ships the chapters (about
1.5 MB with their figures) as the package data ``d2ldist/chapters``; in a clone they are
``notebooks/``, and this module finds either. A copy, not the files in place: a reader
runs and edits the chapters, and their ``%%writefile`` cells write scripts beside them,
which must not land inside site-packages. Files already in the folder are never
overwritten unless asked (``overwrite=True``, ``--overwrite``): they may hold a reader's
edits and outputs.
"""
import argparse
import shutil
import sys
from pathlib import Path

FIRST = 'multi_machine_training.ipynb'      # chapter 1: a folder with it holds the book


def chapters_folder():
    """Where this d2ldist keeps its chapters: in the package (a wheel) or in the clone."""
    package = Path(__file__).resolve().parent
    for folder in (package / 'chapters', package.parent / 'notebooks'):
        if (folder / FIRST).is_file():
            return folder
    raise FileNotFoundError(f'this d2ldist ({package}) has no chapters: neither '
                            f'{package / "chapters"} nor {package.parent / "notebooks"} holds {FIRST}')


def chapter_files(source=None):
    """The files to copy, relative to the chapters' folder: the chapters, their figures
    and the data measured elsewhere that they show (a GPU machine's figures)."""
    source = Path(source or chapters_folder())
    return sorted(p.relative_to(source) for p in [*source.glob('*.ipynb'),
                  *source.glob('figures/*.svg'), *source.glob('data/*.json')])


def download_chapters(folder: str | Path, overwrite: bool = False) -> list[Path]:
    """Copy the chapters and their figures into ``folder`` (made if need be); return
    the paths written. Refuses, writing nothing, if a file would be overwritten."""
    source, folder = chapters_folder(), Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f'{folder} is a file, not a folder for the chapters')
    names = chapter_files(source)
    there = [n for n in names if (folder / n).exists()]
    if there and not overwrite:
        shown = ', '.join(map(str, there[:2])) + (', ...' if len(there) > 2 else '')
        raise FileExistsError(
            f'{folder} already holds {len(there)} of the chapters\' {len(names)} files '
            f'({shown}): nothing copied; replace them with d2l-book --overwrite '
            '(overwrite=True)')
    written = []
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        written.append(Path(shutil.copyfile(source / name, folder / name)))
    return written


def main(argv=None):
    """``d2l-book [DIR] [--overwrite]``: copy the chapters out; a refusal is one line, exit 1."""
    parser = argparse.ArgumentParser(prog='d2l-book', description=(
        'Copy the chapters of d2ldist (notebooks and their figures) into a folder, '
        'to open them with Jupyter.'))
    parser.add_argument('folder', nargs='?', default='d2ldist-book',
                        help='where to put them (default: ./d2ldist-book)')
    parser.add_argument('--overwrite', action='store_true',
                        help='replace files of the same names already there')
    args = parser.parse_args(argv)
    try:
        written = download_chapters(args.folder, overwrite=args.overwrite)
    except OSError as e:          # no chapters, a file in the way, a refusal
        print(f'd2l-book: {e}', file=sys.stderr)
        return 1
    chapters = sum(p.suffix == '.ipynb' for p in written)
    data = sum(p.suffix == '.json' for p in written)
    print(f'd2l-book: {chapters} chapters, {len(written) - chapters - data} figures and '
          f'{data} data file{"s" * (data != 1)} in {args.folder}; open them with:  '
          f'jupyter lab {args.folder}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
