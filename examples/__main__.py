"""``python -m d2ldist.examples``: each example's name and first line, and how to run one."""
import ast
from pathlib import Path

here = Path(__file__).resolve().parent
for path in sorted(here.glob('*.py')):
    if not path.name.startswith('_'):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ''
        print(f'{path.stem:30} {doc.splitlines()[0] if doc else ""}')
print('\nrun one as its docstring says, with python -m d2ldist.examples.NAME for the file:\n'
      '    d2l-launch -n 2 -s 2 python -m d2ldist.examples.hello_roles\n'
      f'(the files: {here})')
