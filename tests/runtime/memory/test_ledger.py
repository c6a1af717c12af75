import torch

from vpipe_lab.runtime.memory.ledger import Ledger, module_grad_bytes, module_param_bytes, optimizer_bytes, tensor_bytes


def test_ledger_moves_bytes_between_device_and_host() -> None:
    led = Ledger()
    led.add(0, 1, 100)
    led.add(1, 1, 50)
    assert led.current == 150 and led.peak == 150
    led.to_host(0, 1, 100)
    assert led.current == 50 and led.host_current == 100 and led.host_peak == 100
    led.to_device(0, 1, 100)
    assert led.current == 150 and led.host_current == 0
    led.release(0, 1)
    assert led.current == 50 and led.by_layer_peak([1]) == {1: 50}
    led.reset_peaks()
    assert led.peak == 50


def test_static_bytes_of_a_module_and_optimizer() -> None:
    layer = torch.nn.Linear(4, 3)
    assert module_param_bytes(layer) == (12 + 3) * 4 and module_grad_bytes(layer) == 0
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert module_grad_bytes(layer) == 60 and optimizer_bytes(opt) >= 2 * 60
    assert tensor_bytes(torch.zeros(10)[2:5]) == 12  # a view counts its own elements
