"""Grammar errors, apart from grammar.py so that raising or catching them does not
import xgrammar (slow to import; a worker without grammars never needs it)."""


class GrammarError(ValueError):
    """An invalid schema, regex or EBNF, or an unknown kind."""


class GrammarOverflow(Exception):
    """The cursor cannot go on: no token is allowed, or the chosen one is not."""
