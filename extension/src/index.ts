// anywidget entry point of vpipe_lab's partition editor.
import { PartitionView, type Model } from "./view";

function render({ model, el }: { model: Model; el: HTMLElement }): () => void {
  const view = new PartitionView(model, el);
  return () => view.destroy();
}

export default { render };
