"""Semantic validation: a schema-valid request this server cannot honour gets a 400.

Each refusal names the `param` at fault, as the OpenAI API does. Images are checked for
what they are first (a data URL of an allowed type, within the size limit, decodable), and
only then refused because the model reads text only, so a broken image and an unsupported
one get different, accurate errors.
"""

import base64
import binascii
import io

from once.gateway.aliases import ModelAliases
from once.gateway.model import ModelRuntime
from once.gateway.pause_hints import pause_table
from once.gateway.prompt.constraints import callable_tools, check_tool_grammars, forced_names
from once.gateway.prompt.tool_items import OUTPUT_TYPES, output_item_text
from once.protocol.errors import InvalidRequestError, ModelNotFoundError
from once.protocol.responses import MESSAGE, ResponsesRequest, message_text

IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
TEXT_FORMATS = ("text", "json_schema", "json_object")
FORCEABLE_CHOICES = ("function", "custom", "allowed_tools")
MAX_IMAGE_BYTES = 20 * 1024 * 1024
ANSWER_TYPES = ("function_call_output", "custom_tool_call_output")  # of a client's calls


def check_semantics(
    request: ResponsesRequest, models: dict[str, ModelRuntime], aliases: ModelAliases
) -> ModelRuntime:
    served = aliases.resolve(request.model)
    model = models.get(served) if served is not None else None
    if model is None:
        raise ModelNotFoundError(
            f"the model {request.model!r} does not exist on this server "
            f"(available: {', '.join(sorted(models))})",
            param="model",
        )
    check_tool_choice(request)
    check_tool_grammars(request.tools)
    pause_table(request.metadata)  # raises on a malformed tool pause hint
    if request.background:
        raise InvalidRequestError("background responses are not supported", param="background")
    if request.text_format not in TEXT_FORMATS:
        raise InvalidRequestError(
            f"text.format {request.text_format!r} is not supported", param="text.format"
        )
    if request.text_format == "json_object" and not _mentions_json(request):
        # OpenAI's own rule: without it a model may emit whitespace until the token limit.
        raise InvalidRequestError(
            "the input must contain the word 'json' to use text.format 'json_object'",
            param="text.format",
        )
    check_output_limit(request, model)
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise InvalidRequestError("temperature must be in [0, 2]", param="temperature")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    # A warm-up may hold no items: Codex prewarms with `input: []` and its tools.
    if not request.input_items and not request.previous_response_id and request.generate:
        raise InvalidRequestError("input must not be empty", param="input")
    if request.previous_response_id is None:
        check_call_ids(request.input_items)
    for i, item in enumerate(request.input_items):
        if item["type"] != MESSAGE or isinstance(item.get("content"), str):
            continue
        for j, part in enumerate(item.get("content") or ()):
            if part.get("type") == "input_image":
                check_image(part, f"input[{i}].content[{j}]")
                if not model.accepts_images:
                    raise InvalidRequestError(
                        f"the model {model.name!r} reads text only; it cannot take images",
                        param=f"input[{i}].content[{j}]",
                    )
            elif part.get("type") == "input_file":
                raise InvalidRequestError(
                    "file inputs are not supported", param=f"input[{i}].content[{j}]"
                )
    return model


def check_output_limit(request: ResponsesRequest, model: ModelRuntime) -> None:
    """At least 1, at most the model's context (its longest possible output), as OpenAI
    and Anthropic refuse a limit above a model's maximum output. A limit that fits the
    context but not beside this prompt is cut to the room left (finish "length")."""
    limit, param = request.max_output_tokens, request.max_output_tokens_param
    if limit is None:
        return
    if limit < 1:
        raise InvalidRequestError(f"{param} must be >= 1, got {limit}", param=param)
    if limit > model.max_model_len:
        raise InvalidRequestError(
            f"{param} is too large: {limit}. The model {model.name!r} supports at most "
            f"{model.max_model_len} output tokens (its context length)",
            param=param,
        )


def check_call_ids(items: tuple[dict, ...]) -> None:
    """A whole conversation (no previous response to hold the calls): a tool's output
    answers a call that came before it, as OpenAI's API refuses one that answers none."""
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        call_id = item.get("call_id")
        # A program's nested calls are `<its call_id>#<n>` (program_tool.py): their outputs
        # may come without the call items (the program is replayed to find them).
        caller = call_id.split("#", 1)[0] if isinstance(call_id, str) else None
        if item["type"] in ANSWER_TYPES and call_id not in call_ids and caller not in call_ids:
            raise InvalidRequestError(
                f"no tool call found for {item['type']} with call_id {call_id!r}",
                param=f"input[{i}].call_id",
            )
        if call_id is not None:
            call_ids.add(call_id)


def check_tool_choice(request: ResponsesRequest) -> None:
    """A choice that forces a call needs tools it can name (constraints.py enforces it)."""
    choice = request.tool_choice
    if choice in ("auto", "none"):
        return
    if choice != "required" and not (
        isinstance(choice, dict) and choice.get("type") in FORCEABLE_CHOICES
    ):
        raise InvalidRequestError(
            f"tool_choice {choice!r} is not supported here (hosted tools have no backend)",
            param="tool_choice",
        )
    tools = callable_tools(request.prompt_tools, request.input_items)
    if not tools:
        raise InvalidRequestError(
            "tool_choice forces a call but there are no tools", param="tool_choice"
        )
    forced_names(choice, tools)  # raises for a name the request does not declare


def _mentions_json(request: ResponsesRequest) -> bool:
    texts = [request.instructions or ""]
    texts += [message_text(i) for i in request.input_items if i["type"] == MESSAGE]
    return any("json" in text.lower() for text in texts)


def check_image(part: dict, param: str) -> None:
    """Type, size and decodability of an inline image (remote URLs are not fetched)."""
    url = part.get("image_url")
    if part.get("file_id") or not url:
        raise InvalidRequestError("images must be inline data URLs", param=param)
    if not url.startswith("data:"):
        raise InvalidRequestError(
            "only data: URLs are accepted (this server fetches nothing)", param=param
        )
    header, _, payload = url[5:].partition(",")
    mime, _, encoding = header.partition(";")
    if mime not in IMAGE_TYPES or encoding != "base64":
        raise InvalidRequestError(
            f"image must be base64 {', '.join(IMAGE_TYPES)}, got {header!r}", param=param
        )
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"image larger than {MAX_IMAGE_BYTES} bytes", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image data is not valid base64", param=param) from None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise InvalidRequestError(f"image cannot be decoded: {e}", param=param) from None


def safety_texts(items) -> list[str]:
    """What the input classifiers read: the text of new messages and tool outputs."""
    texts = []
    for item in items:
        if item["type"] == MESSAGE:
            texts.append(message_text(item))
        elif item["type"] in OUTPUT_TYPES:
            texts.append(output_item_text(item))
    return [t for t in texts if t]
