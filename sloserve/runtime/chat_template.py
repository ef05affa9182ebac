"""--chat-template: a Jinja chat template given as a file path or as the template itself,
checked when the server starts (a typo is an error naming the option, not a 400 on every
chat request)."""

from __future__ import annotations

from pathlib import Path


def load_chat_template(value: str) -> str:
    """The template text of `value`: the contents of the file it names, else `value` itself
    when it is a Jinja template (has `{{` or `{%`). Raises ValueError otherwise or when the
    template does not parse."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {value!r}: {e}") from None
        origin = str(path)
    elif "{{" in value or "{%" in value:
        text, origin = value, "the template string"
    else:
        raise ValueError(f"{value!r} is neither a file nor a Jinja template (a template "
                         "contains {{ ... }} or {% ... %})")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{origin}: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return text
