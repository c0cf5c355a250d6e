"""One text field of a `multipart/form-data` body (the OpenAI API's audio and image uploads), found
without parsing the rest, so a forwarded upload is routed by its `model` like a JSON body, and only
that field's bytes change when its `provider/` prefix is stripped. Pure: no I/O.
"""

from __future__ import annotations

from email.message import Message


def _param(header: str, value: str, name: str) -> str | None:
    message = Message()
    message[header] = value
    found = message.get_param(name, header=header)
    return found if isinstance(found, str) else None


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a `multipart/form-data` content type, None for anything else."""
    if content_type.partition(";")[0].strip().lower() != "multipart/form-data":
        return None
    boundary = _param("content-type", content_type, "boundary")
    if not boundary or len(boundary) > 200:  # RFC 2046: at most 70 characters
        return None
    try:
        return boundary.encode("ascii")
    except UnicodeEncodeError:
        return None


def _names_field(head: bytes, name: str) -> bool:
    """Whether a part's header block is the form field `name` (not a file upload)."""
    for line in head.split(b"\r\n"):
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == b"content-disposition":
            text = value.decode("latin-1").strip()
            return (_param("content-disposition", text, "name") == name
                    and _param("content-disposition", text, "filename") is None)
    return False


def text_field(raw: bytes, content_type: str, name: str) -> tuple[str, slice] | None:
    """The UTF-8 value of the form field `name` and where its bytes lie in `raw`; None when the body is
    not multipart, has no such field, or is malformed before it (the upstream judges that)."""
    boundary = boundary_of(content_type)
    if boundary is None:
        return None
    delimiter = b"--" + boundary
    at = raw.find(delimiter)
    while at != -1 and (at == 0 or raw[at - 2:at] == b"\r\n"):
        start = at + len(delimiter)
        if raw[start:start + 2] == b"--":  # the closing delimiter
            return None
        line_end = raw.find(b"\r\n", start)  # past transport padding
        head_end = raw.find(b"\r\n\r\n", line_end) if line_end != -1 else -1
        if head_end == -1:
            return None
        value_start = head_end + 4
        end = raw.find(b"\r\n" + delimiter, value_start)
        if end == -1:
            return None
        if _names_field(raw[line_end + 2:head_end], name):
            try:
                return raw[value_start:end].decode("utf-8"), slice(value_start, end)
            except UnicodeDecodeError:
                return None
        at = end + 2
    return None


def replace_field(raw: bytes, where: slice, value: str) -> bytes:
    """`raw` with the field at `where` (from `text_field`) holding `value`."""
    return raw[:where.start] + value.encode("utf-8") + raw[where.stop:]
