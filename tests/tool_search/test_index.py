import random

import numpy as np
import pytest

from once.tool_search import (
    EmbeddingCache,
    HashedWordEmbedder,
    ToolDoc,
    ToolIndex,
    expand_query,
    split_identifier,
)
from once.tool_search.documents import embedding_text, terms
from once.tool_search.semantic import reciprocal_rank_fusion


def doc(namespace, name, description, **properties):
    schema = {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()}}
    return ToolDoc(name, description, schema, namespace)


DOCS = [
    doc("alpha", "search", "Look something up.", q="string"),
    doc("beta", "search", "Search the web: search pages, search news, search images.", q="string"),
    doc("gamma", "web_search", "Search the web for pages and news.", query="string"),
    doc("gamma", "getPageContent", "Download a web page by its URL.", url="string"),
    doc("files", "write_file", "Create or overwrite a file with new content.", path="string"),
    doc("clock", "get_current_time", "The current time in a timezone.", timezone="string"),
    doc("trains", "get_tickets", "查询12306余票信息", date="string"),
]


@pytest.fixture(scope="module")
def index():
    return ToolIndex.from_docs(DOCS)


def names(docs):
    return [d.qualified_names()[0] for d in docs]


# --- the bm25 ranker -----------------------------------------------------------------


def test_namespaced_exact_name_ranks_first_over_better_bm25_matches(index):
    # BM25 alone prefers beta.search (its description says "search" four times).
    assert names(index.search("alpha.search", 3))[0] == "alpha.search"
    assert names(index.search("alpha__search", 1)) == ["alpha.search"]
    assert names(index.search("`ALPHA.search`", 1)) == ["alpha.search"]


def test_a_bare_name_shared_by_namespaces_ranks_all_of_them_first(index):
    top = names(index.search("search", 3))
    assert set(top[:2]) == {"alpha.search", "beta.search"}
    assert top[2] == "gamma.web_search"


def test_an_identifier_inside_the_query_is_boosted(index):
    assert names(index.search("please call web_search for me", 1)) == ["gamma.web_search"]
    assert names(index.search("then getPageContent of it", 1)) == ["gamma.getPageContent"]


def test_prefix_queries_match_namespaces_and_names(index):
    assert set(names(index.search("gamma.", 5))) == {"gamma.getPageContent", "gamma.web_search"}
    assert names(index.search("get_cur", 5))[0] == "clock.get_current_time"


def test_bm25_over_split_names_and_parameters(index):
    assert names(index.search("download page content from a url", 1)) == ["gamma.getPageContent"]
    # "timezone" is only a parameter name.
    assert names(index.search("timezone", 1)) == ["clock.get_current_time"]


def test_query_expansion_finds_implicit_needs(index):
    assert names(index.search("put the report in /root/out/report.md", 1)) == ["files.write_file"]
    assert names(index.search("what trains leave tomorrow", 1)) == ["clock.get_current_time"]
    assert "current date time" in expand_query("news from yesterday")
    assert expand_query("news from yesterday", ["path"]) == "news from yesterday"
    assert expand_query("plain words") == "plain words"


def test_cjk_queries_match_cjk_descriptions(index):
    assert names(index.search("余票", 1)) == ["trains.get_tickets"]


def test_no_match_and_empty_queries_return_nothing(index):
    assert index.search("zzzqqq", 5) == []
    assert index.search("   ", 5) == []
    assert index.search("the of and", 5) == []


def test_select_is_exact_ordered_and_reports_unknown_names(index):
    found = index.search("select:clock.get_current_time, gamma__web_search,search", 10)
    assert names(found) == [
        "clock.get_current_time",
        "gamma.web_search",
        "alpha.search",
        "beta.search",
    ]
    selection = index.select("nope, files.write_file, files.write_file")
    assert names(selection.tools) == ["files.write_file"]
    assert selection.unknown == ["nope"]


def test_ranking_does_not_depend_on_registration_order():
    shuffled = DOCS[:]
    random.Random(7).shuffle(shuffled)
    a, b = ToolIndex.from_docs(DOCS), ToolIndex.from_docs(shuffled)
    for query in ("search the web", "search", "gamma", "a file", "time"):
        assert names(a.search(query, 10)) == names(b.search(query, 10))


def test_answers_are_the_payloads_given():
    index = ToolIndex([(d, f"payload of {d.name}") for d in DOCS])
    assert index.search("timezone", 1) == ["payload of get_current_time"]
    assert index.select("files.write_file").tools == ["payload of write_file"]
    assert len(index) == len(DOCS) and ToolIndex.from_docs([]).search("x") == []


def test_plain_ranker_has_no_boosts():
    plain = ToolIndex.from_docs(DOCS, ranker="plain")
    assert names(plain.search("alpha.search", 1)) != ["alpha.search"]
    with pytest.raises(ValueError, match="unknown ranker"):
        ToolIndex.from_docs(DOCS, ranker="magic")


def test_terms_split_identifiers_drop_stop_words_and_stem():
    assert split_identifier("getBaziDetail") == "get Bazi Detail"
    assert split_identifier("get-weread_rank.v2") == "get weread rank v2"
    assert split_identifier("HTMLToText") == "HTML To Text"
    assert terms("Please help me with searching the files") == ["search", "file"]


# --- the hybrid ranker ---------------------------------------------------------------

# A fake embedding model that knows synonyms: each group of words is one dimension.
CONCEPTS = [
    {"weather", "forecast", "rain", "umbrella", "sunny"},
    {"song", "music", "melody", "tune"},
    {"web", "page", "search", "news", "url", "download"},
]


def concept_embedder(texts):
    vectors = np.full((len(texts), len(CONCEPTS) + 1), 1e-3, dtype=np.float32)
    for row, text in enumerate(texts):
        for word in split_identifier(text).lower().replace(":", " ").split():
            for dim, group in enumerate(CONCEPTS):
                vectors[row, dim] += word in group
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


HYBRID_DOCS = [*DOCS, doc("meteo", "get_forecast", "Forecast for a city.", city="string")]


def test_the_hybrid_ranker_finds_tools_by_meaning_bm25_misses():
    bm25 = ToolIndex.from_docs(HYBRID_DOCS)
    hybrid = ToolIndex.from_docs(HYBRID_DOCS, ranker="hybrid", embedder=concept_embedder)
    assert bm25.search("do I need an umbrella", 1) == []  # no shared word
    assert names(hybrid.search("do I need an umbrella", 1)) == ["meteo.get_forecast"]
    # Both halves agree: still first.
    assert names(hybrid.search("download page content from a url", 1)) == ["gamma.getPageContent"]


def test_the_hybrid_ranker_keeps_the_name_tiers_and_select():
    hybrid = ToolIndex.from_docs(HYBRID_DOCS, ranker="hybrid", embedder=concept_embedder)
    assert names(hybrid.search("alpha.search", 1)) == ["alpha.search"]
    assert set(names(hybrid.search("search", 2))) == {"alpha.search", "beta.search"}
    assert names(hybrid.search("select:meteo.get_forecast", 5)) == ["meteo.get_forecast"]
    assert hybrid.search("the of and", 5) == []  # no search term: nothing to embed for
    with pytest.raises(ValueError, match="needs an embedder"):
        ToolIndex.from_docs(DOCS, ranker="hybrid")


def test_the_hybrid_ranker_embeds_each_tool_once_and_each_query_once():
    seen: list[list[str]] = []

    def recording(texts):
        seen.append(list(texts))
        return HashedWordEmbedder()(texts)

    hybrid = ToolIndex.from_docs(DOCS, ranker="hybrid", embedder=recording)
    assert seen == [[embedding_text(d) for d in hybrid.docs]]
    hybrid.search("search the web", 3)
    assert seen[1:] == [["search the web"]]


def test_reciprocal_rank_fusion_adds_weighted_inverse_ranks():
    fused = reciprocal_rank_fusion([(np.array([2, 0]), 1.0), (np.array([0, 1, 2]), 0.5)], 3, 10)
    assert fused == pytest.approx([1 / 11 + 0.5 / 10, 0.5 / 11, 1 / 10 + 0.5 / 12])


def test_embedding_cache_embeds_each_text_once_and_forgets_the_oldest():
    calls: list[list[str]] = []

    def embed(texts):
        calls.append(list(texts))
        return HashedWordEmbedder()(texts)

    cache = EmbeddingCache(embed, max_entries=2)
    first = cache(["a web page", "rain", "a web page"])
    assert calls == [["a web page", "rain"]]
    assert np.array_equal(first[0], first[2])
    cache(["rain", "music"])  # "a web page" is now the oldest: out
    assert calls[-1] == ["music"]
    cache(["a web page"])
    assert calls[-1] == ["a web page"]


def test_hashed_word_embedder_gives_unit_rows_near_for_shared_terms():
    vectors = HashedWordEmbedder()(["search web pages", "web page search", "rain", ""])
    assert np.linalg.norm(vectors[:3], axis=1) == pytest.approx([1, 1, 1])
    assert vectors[0] @ vectors[1] == pytest.approx(1.0)
    assert vectors[0] @ vectors[2] < 0.5
    assert not vectors[3].any()
