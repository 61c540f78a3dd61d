import torch
from models import MLP

import sparta
from sparta.backend import to_graph_module


def test_graph_module_state_dict_matches_model_and_replacements_plug_in():
    model = MLP().eval()
    x = torch.randn(3, 24)
    graph = sparta.capture(model, (x,))
    gm = to_graph_module(graph)
    assert set(gm.state_dict()) == set(model.state_dict())
    assert torch.equal(gm(x)[0], model(x))

    class Doubler(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    gm2 = to_graph_module(graph, replacements={"relu": Doubler()})
    assert any(n.op == "call_module" for n in gm2.graph.nodes)
    assert not torch.equal(gm2(x)[0], model(x))
    w = {"fc3.weight": torch.zeros(10, 48)}
    assert torch.equal(to_graph_module(graph, w)(x)[0], model.fc3.bias.detach().expand(3, 10))


def test_tensors_created_on_the_capture_device_follow_the_module():
    class AddPositions(torch.nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[-1], dtype=x.dtype)

    gm = to_graph_module(sparta.capture(AddPositions(), (torch.randn(2, 5),)))
    assert "_sparta_device" not in gm.state_dict()
    torch.testing.assert_close(gm(x := torch.randn(2, 5))[0], x + torch.arange(5.0))
    out = gm.to("meta")(torch.randn(2, 5, device="meta"))[0]
    assert out.device.type == "meta"
