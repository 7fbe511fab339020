"""The names torch gives a process group, where torch's compiler may read them.

``torch.distributed._functional_collectives`` reads ``group.group_name`` inside the functions
that ``torch.compile`` traces. On a Python process group that attribute is a property, which
Dynamo traces into; it refuses to trace a file on its skip list, and meshcomm puts its
communication code there (:mod:`meshcomm.common.dynamo_skip`). These properties live in this
module of their own, which stays traceable: it only reads strings.

Example:
    >>> names = GroupNames()
    >>> names.setGroupName("0"); names.setGroupDesc("default_pg")
    >>> names.group_name, names.getGroupDesc()
    ('0', 'default_pg')
"""

from __future__ import annotations

__all__ = ["GroupNames"]


class GroupNames:
    """torch's unique name and description of a group: set by torch once the group is made
    (``setGroupName``, ``setGroupDesc``), read by torch and its compiled code.

    Example:
        >>> GroupNames().group_desc
        'undefined'
    """

    _group_name = ""
    _group_desc = "undefined"

    def getGroupName(self) -> str:
        """torch's unique name of the group."""
        return self._group_name

    def setGroupName(self, name: str) -> None:
        """Set by torch once the group is made."""
        self._group_name = name

    def getGroupDesc(self) -> str:
        """torch's description of the group (``"default_pg"``, a mesh axis's)."""
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        """Set by torch once the group is made."""
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        """torch's unique name of the group."""
        return self._group_name

    @property
    def group_desc(self) -> str:
        """torch's description of the group."""
        return self._group_desc
