"""The one exception type for problems a user can fix.

Its message is a single line that names the problem and the fix; the CLI prints it and exits 2.
"""


class PrecsearchError(ValueError):
    """A user-fixable problem: bad spec, bad file, bad option. Subclasses ValueError so callers may catch either."""
