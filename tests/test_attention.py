"""What the jobs' HF encoders get as an attention mask (jobs/attention.py): the 2D mask's logits, without a
device-side check of the mask, and no mask built for an unpadded batch where the model is traced (compiled)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from jobs.attention import SDPA_UNMASKED, mask_form, model_inputs, use_sdpa_unmasked
from jobs.bench import bert_from_config
from jobs.bert import classification_model, masked_lm_model


@pytest.mark.parametrize("attention", ["sdpa", "eager", SDPA_UNMASKED])
def test_the_mask_form_gives_the_2d_masks_logits_for_hf_encoders_and_leaves_decoders_alone(attention: str) -> None:
    """The jobs pass a padded batch's mask in a form HF does not check on the device where they know one
    (transformers 5: additive 4D; 4 with SDPA: BERT/RoBERTa's batch x 1 x seq), else the 2D mask as it is:
    the same logits for the encoders a user may name in model.pretrained, and a decoder keeps its causal
    mask (CI's floor run has transformers 4.45.2). With SDPA_UNMASKED (what the jobs build on transformers 5),
    the model given the 2D mask itself, or no mask for an unpadded batch, still gives the plain SDPA logits."""
    import transformers as hf

    small = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64}
    models = {"bert": (hf.BertConfig(**small), hf.BertForSequenceClassification),
              "bert-relative": (hf.BertConfig(**small, position_embedding_type="relative_key"), hf.BertForMaskedLM),
              "bert-decoder": (hf.BertConfig(**small, is_decoder=True), hf.BertLMHeadModel),
              "roberta": (hf.RobertaConfig(**small), hf.RobertaForSequenceClassification),
              "albert": (hf.AlbertConfig(**small, embedding_size=16), hf.AlbertForSequenceClassification),
              "electra": (hf.ElectraConfig(**small, embedding_size=16), hf.ElectraForSequenceClassification),
              "distilbert": (hf.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64),
                             hf.DistilBertForSequenceClassification),
              "gpt2": (hf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, pad_token_id=0),
                       hf.GPT2ForSequenceClassification)}  # causal: a prepared 4D mask would replace that
    ids = torch.randint(5, 90, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = mask[2, 3:] = 0
    checked = []
    for name, (config, cls) in models.items():
        config._attn_implementation = "sdpa" if attention == SDPA_UNMASKED else attention
        torch.manual_seed(1)
        try:
            model = cls(config).eval()
        except ValueError:  # this transformers has no SDPA for it
            continue
        with torch.no_grad():
            as_2d, unpadded = model(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids).logits
            if attention == SDPA_UNMASKED:
                model = use_sdpa_unmasked(model)
                torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, as_2d, rtol=0, atol=0)
                torch.testing.assert_close(model(input_ids=ids).logits, unpadded, rtol=0, atol=0)
            ours = model(**model_inputs(model, {"input_ids": ids, "attention_mask": mask, "padded": True})).logits
        real = mask.bool() if as_2d.dim() == 3 else slice(None)  # per-token outputs: padding rows are noise
        torch.testing.assert_close(ours[real], as_2d[real], rtol=0, atol=0, msg=name)
        checked.append((name, mask_form(model), model.config._attn_implementation))
    forms = {name: form for name, form, _ in checked}
    assert forms["bert-decoder"] is None and forms["gpt2"] is None and {"bert", "roberta", "albert"} <= set(forms)
    if attention != "eager":  # the models that would check a 2D mask on the device get another form
        assert forms["bert"] and forms["roberta"], forms
    if attention == SDPA_UNMASKED and forms["bert"] == "additive":  # transformers 5: the encoders switched, no other
        switched = {name for name, _, implementation in checked if implementation == SDPA_UNMASKED}
        assert {"bert", "roberta", "bert-relative"} <= switched and not switched & {"bert-decoder", "gpt2"}, checked


def sdpa_masks(graph: torch.fx.Graph) -> list[list[str]]:
    """Per SDPA call in `graph`, its tensor inputs other than query, key and value: the mask, if any."""
    return [[str(a) for a in [*node.args[3:], *node.kwargs.values()] if isinstance(a, torch.fx.Node)]
            for node in graph.nodes if "scaled_dot_product" in str(node.target)]


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="transformers 4's encoders build their masks themselves")
@pytest.mark.parametrize("job", ["bench", "bert", "bert_mlm"])
def test_a_traced_encoder_builds_no_mask_for_an_unpadded_batch(job: str, tiny_bert: Path) -> None:
    """Compiled, transformers 5 cannot look at a mask, so before 5.2x (the H100's 5.17) it built an all-True
    (batch, 1, seq, seq) mask for a batch given none, and SDPA ran its masked kernel where eager runs
    FlashAttention. The models the jobs build get no mask: in dynamo's graph (torch.compile) and in
    torch.export's, where this transformers still builds one for the plain SDPA model (the control)."""
    build = {"bench": lambda: bert_from_config(2, 32, 2, max_length=16),
             "bert": lambda: classification_model(str(tiny_bert), num_labels=2),
             "bert_mlm": lambda: masked_lm_model(str(tiny_bert))}[job]
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(1000, 30000, (4, 16), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, **({"labels": ids, "masked_positions": torch.arange(3)} if job == "bert_mlm" else {})}
    assert model.config._attn_implementation == SDPA_UNMASKED
    graphs = []

    def keep_graph(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph_module.graph)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=keep_graph, fullgraph=True)(**inputs)
    exported = torch.export.export(model, (), inputs).graph
    assert len(graphs) == 1 and sdpa_masks(graphs[0]) == [[], []] and sdpa_masks(exported) == [[], []]
    model.set_attn_implementation("sdpa")
    masks = sdpa_masks(torch.export.export(model, (), inputs).graph)
    assert len(masks) == 2 and all(masks), masks  # the control: the plain SDPA model gets a mask built
