"""A Redis URL as logs and messages may show it: no redis-py import, so the store spec's parser (and every
command that parses ``--store`` without opening a Redis tier) stays light."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: the ``user:PASS@`` part and a ``?password=`` argument
    (redis-py logs in with either).

    Args:
        url: a Redis URL.

    Returns:
        The URL as logs and messages may show it.
    """
    try:
        parts = urlsplit(url)
        out = url
        if parts.password is not None:
            host = parts.hostname or ""
            host = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
            netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
            out = urlunsplit(parts._replace(netloc=netloc))
        if parts.query:  # the rest of the URL as written (urlunsplit would respell unix:///path as unix:/path)
            query = "&".join(f"{pair.partition('=')[0]}=***" if pair.partition("=")[0].lower() == "password"
                             else pair for pair in parts.query.split("&"))
            out = out.replace("?" + parts.query, "?" + query, 1)
        return out
    except ValueError:  # a port that is not a number, brackets: show nothing of it rather than a secret
        return "redis://<unparsable url>"
