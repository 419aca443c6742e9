"""The chaos suite: real processes under faults, audited by the invariant checker."""
