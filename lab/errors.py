"""One exception type for every lab failure: its message is the one line the user sees."""


class LabError(Exception):
    pass
