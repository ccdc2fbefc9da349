// Freezing and parameter groups (issue 24, train/src/param_groups.h): glob patterns over HF names,
// frozen parameters without gradients or optimizer state (tags and state sizes), no-decay groups and
// the vision tower's lr multiplier against a float64 AdamW, stage 1 of a LLaVA recipe moving only the
// projector (every other parameter bitwise unchanged), and the planner counting trainable parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/vlm.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/optimizer.h"
#include "kestrel/train/trainer.h"
#include "kestrel/train/vlm_data.h"
#include "support/numerics.h"
#include "train/src/param_groups.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

TEST(ParamGroups, GlobMatchesWholeNames) {
  EXPECT_TRUE(glob_match("multi_modal_projector.*", "multi_modal_projector.linear_1.weight"));
  EXPECT_FALSE(glob_match("multi_modal_projector.*", "vision_tower.multi_modal_projector.x"));
  EXPECT_TRUE(glob_match("*", "anything.at.all"));
  EXPECT_TRUE(glob_match("*.bias", "a.b.bias"));
  EXPECT_FALSE(glob_match("*.bias", "a.bias.weight"));
  EXPECT_TRUE(glob_match("language_model.model.layers.?.mlp.*", "language_model.model.layers.3.mlp.up_proj.weight"));
  EXPECT_FALSE(glob_match("language_model.model.layers.?.mlp.*", "language_model.model.layers.13.mlp.up_proj.weight"));
  EXPECT_TRUE(glob_match("a*b*c", "a-b-x-b-c"));
  EXPECT_FALSE(glob_match("a*b*c", "a-b-x-b-"));
  EXPECT_TRUE(glob_match("", ""));
}

TEST(ParamGroups, ConfigErrorsNameTheKey) {
  json cfg = testing::tiny_vlm_run("/tmp/unused", json::object());
  auto msg = [](const json& c) {
    try {
      (void)ParameterGroupRules::from_config(c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  json bad = cfg;
  bad["train"]["trainable"] = json::array();
  EXPECT_NE(msg(bad).find("train.trainable"), std::string::npos);
  bad["train"]["trainable"] = json::array({3});
  EXPECT_NE(msg(bad).find("train.trainable"), std::string::npos);
  bad = cfg;
  bad["train"]["weight_decay_params"] = "norms";
  EXPECT_NE(msg(bad).find("train.weight_decay_params"), std::string::npos);
  bad = cfg;
  bad["train"]["vision_lr_scale"] = -1.0;
  EXPECT_NE(msg(bad).find("train.vision_lr_scale"), std::string::npos);
  // A pattern that matches nothing is refused naming it (a typo would freeze everything).
  ParameterGroupRules r;
  r.trainable = {"multimodal_projector.*"};
  try {
    r.check_names({"multi_modal_projector.linear_1.weight"});
    ADD_FAILURE() << "a pattern matching nothing was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"multimodal_projector.*\" matches no parameter"), std::string::npos)
        << e.what();
  }
}

// train.vision_lr_scale on a model without a vision tower (model.type "decoder") changed nothing
// and was accepted silently; it is refused naming the key. At 1 (the default) it is fine anywhere.
TEST(ParamGroups, VisionLrScaleWithoutATowerIsRefused) {
  ParameterGroupRules r;
  r.vision_lr_scale = 0.1;
  try {
    r.check_names({"model.embed_tokens.weight", "model.norm.weight"});
    ADD_FAILURE() << "train.vision_lr_scale without a vision tower was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.vision_lr_scale"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(r.check_names({"vision_tower.vision_model.post_layernorm.weight", "multi_modal_projector.linear_1.weight"}));
  r.vision_lr_scale = 1.0;
  EXPECT_NO_THROW(r.check_names({"model.embed_tokens.weight"}));
}

models::VlmConfig tiny_config(bool untied_qwen3) {
  json cfg = testing::tiny_vlm_run("/tmp/unused", json::object());
  if (untied_qwen3) {
    cfg["model"]["config"]["text_config"]["model_type"] = "qwen3";
    cfg["model"]["config"]["text_config"]["head_dim"] = 16;
    cfg["model"]["config"]["text_config"]["tie_word_embeddings"] = false;
    cfg["model"]["config"]["text_config"]["num_hidden_layers"] = 2;
  }
  return models::VlmConfig::from_json(cfg["model"]["config"], "test");
}

TEST(ParamGroups, ParameterSizesAreTheModelsOwn) {
  for (bool variant : {false, true}) {
    models::VlmConfig mc = tiny_config(variant);
    models::Vlm vlm(mc, DType::F32, Device::cpu(), 1);
    auto sizes = model_parameter_sizes(mc, true);
    ASSERT_EQ(sizes.size(), vlm.parameters().size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(sizes[i].first, vlm.parameters().items()[i].first);
      EXPECT_EQ(sizes[i].second, vlm.parameters().items()[i].second->numel()) << sizes[i].first;
    }
    models::Decoder dec(mc.text_config, DType::F32, Device::cpu(), 1);
    auto text = model_parameter_sizes(mc, false);
    ASSERT_EQ(text.size(), dec.parameters().size());
    for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(text[i].first, dec.parameters().items()[i].first);
  }
}

// Stage 1 by hand: after one backward only the projector holds gradients, AdamW keeps state for it
// alone (its state size and the OptimizerState tag both say 8 bytes per f32 parameter: two f32
// moments), and the Gradient tag holds no parameter gradient of a frozen tensor.
TEST(ParamGroups, FrozenParametersHaveNoGradientNorState) {
  models::VlmConfig mc = tiny_config(false);
  models::Vlm vlm(mc, DType::F32, Device::cpu(), 3);
  ParameterGroupRules rules;
  rules.trainable = {"multi_modal_projector.*"};
  const int64_t trainable = apply_trainable(vlm.parameters(), rules);
  int64_t projector = 0;
  for (auto& [name, p] : vlm.parameters().items())
    if (name.starts_with("multi_modal_projector.")) projector += p->numel();
  EXPECT_EQ(trainable, projector);

  const int64_t state_before = memory_trace(Device::cpu()).snapshot().tags[static_cast<int>(MemoryTag::OptimizerState)].current;
  AdamW opt(vlm.parameters(), AdamWOptions{});
  const int64_t state_after = memory_trace(Device::cpu()).snapshot().tags[static_cast<int>(MemoryTag::OptimizerState)].current;
  EXPECT_EQ(opt.state_bytes(), 8 * projector);
  EXPECT_EQ(state_after - state_before, 8 * projector);
  for (auto& [name, t] : opt.state()) EXPECT_TRUE(name.find("multi_modal_projector.") != std::string::npos) << name;

  ShapesConfig sc;
  sc.image_size = 16;
  ShapesVlmData data(sc, mc.image_tokens_per_image(), Device::cpu(), DType::F32);
  models::VlmBatch batch = data.batch(0, 3);
  const int64_t grads_before = memory_trace(Device::cpu()).snapshot().tags[static_cast<int>(MemoryTag::Gradient)].current;
  {
    Tensor loss = vlm.loss(batch);
    TagScope tag(MemoryTag::Gradient);
    autograd::backward(loss);
  }
  int64_t grad_bytes = 0;
  for (auto& [name, p] : vlm.parameters().items()) {
    const bool trains = name.starts_with("multi_modal_projector.");
    EXPECT_EQ(p->grad().defined(), trains) << name;
    if (p->grad().defined()) grad_bytes += static_cast<int64_t>(p->grad().nbytes());
  }
  EXPECT_EQ(grad_bytes, 4 * projector);
  // What the Gradient tag holds once backward is over: the projector's gradients, nothing more.
  EXPECT_EQ(memory_trace(Device::cpu()).snapshot().tags[static_cast<int>(MemoryTag::Gradient)].current - grads_before,
            grad_bytes);
  vlm.parameters().zero_grad();
}

// AdamW with groups against a float64 AdamW (torch.optim.AdamW's arithmetic): 2-D tensors decay,
// 1-D ones (norms, biases) do not, the vision tower's lr is scaled, a frozen parameter is untouched;
// on the device placement and through the host-offload path (one staging pass per group).
TEST(ParamGroups, NoDecayGroupsMatchFloat64AdamW) {
  struct P {
    std::string name;
    Shape shape;
  };
  const std::vector<P> specs = {{"vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", {5, 3}},
                                {"vision_tower.vision_model.encoder.layers.0.mlp.fc1.bias", {5}},
                                {"multi_modal_projector.linear_1.weight", {4, 7}},
                                {"multi_modal_projector.linear_1.bias", {4}},
                                {"language_model.model.norm.weight", {6}},
                                {"language_model.lm_head.weight", {3, 6}}};
  ParameterGroupRules rules;
  rules.trainable = {"vision_tower.*", "multi_modal_projector.*", "language_model.model.*"};
  rules.vision_lr_scale = 0.25;
  AdamWOptions o;
  o.lr = 3e-2, o.beta1 = 0.9, o.beta2 = 0.95, o.eps = 1e-8, o.weight_decay = 0.1;
  for (OptimizerOffload where : {OptimizerOffload::None, OptimizerOffload::Host}) {
    SCOPED_TRACE(optimizer_offload_name(where));
    std::vector<std::unique_ptr<Tensor>> owned;
    models::ParameterList params;
    std::vector<std::vector<double>> ref, m, v;
    for (const P& s : specs) {
      owned.push_back(std::make_unique<Tensor>(models::make_parameter(s.name, s.shape, DType::F32, Device::cpu())));
      owned.back()->copy_(kestrel::testing::randn(s.shape, DType::F32, Device::cpu(), 0.5));
      params.add(s.name, owned.back().get());
      std::vector<float> f = owned.back()->to_float_vector();
      ref.emplace_back(f.begin(), f.end());
      m.emplace_back(f.size(), 0.0);
      v.emplace_back(f.size(), 0.0);
    }
    apply_trainable(params, rules);
    OptimizerPlacement pl;
    pl.offload = where;
    AdamW opt(params, o, pl, [&](const std::string& name, const Tensor& p) {
      return rules.group(name, p.dim(), o.weight_decay);
    });
    const double lrs[3] = {3e-2, 2e-2, 1e-2};
    for (int step = 1; step <= 3; ++step) {
      for (size_t i = 0; i < specs.size(); ++i) {
        Tensor& p = *owned[i];
        if (!p.requires_grad()) continue;
        Tensor g = kestrel::testing::randn(specs[i].shape, DType::F32, Device::cpu(), 1.0);
        p.set_grad(g);
        // float64 reference: decoupled decay, bias-corrected moments (torch.optim.AdamW).
        const std::vector<float> gf = g.to_float_vector();
        const bool decays = specs[i].shape.size() >= 2;
        const double lr = lrs[step - 1] * (specs[i].name.starts_with("vision_tower.") ? 0.25 : 1.0);
        const double wd = decays ? o.weight_decay : 0.0;
        for (size_t k = 0; k < gf.size(); ++k) {
          m[i][k] = o.beta1 * m[i][k] + (1 - o.beta1) * gf[k];
          v[i][k] = o.beta2 * v[i][k] + (1 - o.beta2) * double(gf[k]) * gf[k];
          const double mh = m[i][k] / (1 - std::pow(o.beta1, step)), vh = v[i][k] / (1 - std::pow(o.beta2, step));
          ref[i][k] = ref[i][k] * (1 - lr * wd) - lr * mh / (std::sqrt(vh) + o.eps);
        }
      }
      opt.step(lrs[step - 1]);
      params.zero_grad();
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      const std::vector<float> got = owned[i]->to_float_vector();
      double worst = 0;  // f32 arithmetic against f64: a few roundings of values of order 1 per step
      for (size_t k = 0; k < got.size(); ++k)
        worst = std::max(worst, std::fabs(got[k] - ref[i][k]) / std::max(1.0, std::fabs(ref[i][k])));
      EXPECT_LT(worst, 1e-6) << specs[i].name;
    }
    // The frozen lm_head is the value it started with, and AdamW has no state for it.
    for (auto& [name, t] : opt.state()) EXPECT_EQ(name.find("lm_head"), std::string::npos) << name;
  }
  // The no-decay rule matters: with every parameter decaying, the norm differs from the reference.
  ParameterGroupRules all = rules;
  all.decay_all = true;
  EXPECT_EQ(all.group("language_model.model.norm.weight", 1, 0.1).weight_decay, 0.1);
  EXPECT_EQ(rules.group("language_model.model.norm.weight", 1, 0.1).weight_decay, 0.0);
  EXPECT_EQ(rules.group("vision_tower.x.weight", 2, 0.1).lr_scale, 0.25);
}

// Stage 1 through the trainer: K steps with train.trainable = the projector; every other parameter
// equals its initial value bit for bit, the projector moved, the checkpoint's optimizer state holds
// the projector's moments only.
TEST(ParamGroups, StageOneMovesOnlyTheProjector) {
  const std::string dir = testing::fresh_temp_dir("kestrel_groups", "stage1");
  json cfg = testing::tiny_vlm_run(dir, {{"steps", 3}, {"batch_size", 4}, {"trainable", {"multi_modal_projector.*"}}},
                                   {{"checkpoint_every", 3}});
  {
    Trainer t(cfg);
    t.run();
  }
  const models::VlmConfig mc = models::VlmConfig::from_json(cfg["model"]["config"], "test");
  models::Vlm init(mc, DType::F32, Device::cpu(), cfg["train"]["seed"].get<uint64_t>());
  models::Vlm trained(mc, DType::F32, Device::cpu(), 99);
  const std::string ckpt = dir + "/checkpoints/step_00000003";
  models::load_safetensors(trained.parameters(), ckpt + "/model.safetensors");
  int moved = 0;
  for (size_t i = 0; i < init.parameters().size(); ++i) {
    const auto& [name, a] = init.parameters().items()[i];
    const Tensor& b = *trained.parameters().items()[i].second;
    const bool same = std::memcmp(a->data_ptr(), b.data_ptr(), a->nbytes()) == 0;
    if (name.starts_with("multi_modal_projector.")) {
      moved += !same;
    } else {
      EXPECT_TRUE(same) << name << " changed although frozen";
    }
  }
  EXPECT_EQ(moved, 4);  // both weights and both biases of the projector
  fs::remove_all(dir);
}

// The planner counts gradient and optimizer-state bytes of trainable parameters only, and still
// agrees with a profiled run per tag (stage 1: projector only; stage 2 with the tower frozen).
TEST(ParamGroups, PlannerCountsTrainableParametersOnly) {
  const std::string dir = testing::fresh_temp_dir("kestrel_groups", "plan");
  for (const json& trainable : {json::array({"multi_modal_projector.*"}),
                                json::array({"multi_modal_projector.*", "language_model.*"})}) {
    SCOPED_TRACE(trainable.dump());
    json cfg = testing::tiny_vlm_run(dir, {{"steps", 2}, {"batch_size", 4}, {"trainable", trainable}}, json::object(), 32, 64);
    PlanOptions po;
    po.steps = 2;
    MemoryPlan plan = plan_memory(cfg, po);
    int64_t trains = 0;
    {  // the model the trainer builds, its trainable count (gone before the profiled run)
      const models::VlmConfig mc = models::VlmConfig::from_json(cfg["model"]["config"], "test");
      models::Vlm vlm(mc, DType::F32, Device::cpu(), 1);
      trains = apply_trainable(vlm.parameters(), ParameterGroupRules::from_config(cfg));
      EXPECT_EQ(plan.parameters, vlm.parameters().numel());
    }
    EXPECT_EQ(plan.trainable_parameters, trains);
    EXPECT_EQ(plan.tag_peak[static_cast<int>(MemoryTag::OptimizerState)], 8 * trains);
    MemoryProfile p = testing::profile_trainer_run(cfg, Device::cpu());
    // Two f32 moments per trainable parameter (+ the step's gradient norm, a scalar under this tag).
    EXPECT_NEAR(p.tag_peak[static_cast<int>(MemoryTag::OptimizerState)], 8 * trains, 16);
    for (MemoryTag t : {MemoryTag::Parameter, MemoryTag::Gradient, MemoryTag::Activation}) {
      const double measured = static_cast<double>(p.tag_peak[static_cast<int>(t)]);
      const double planned = static_cast<double>(plan.tag_peak[static_cast<int>(t)]);
      EXPECT_NEAR(planned / measured, 1.0, 0.10) << tag_name(t) << ": planned " << planned << ", measured " << measured;
    }
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace kestrel::train

namespace kestrel::train {
namespace {
// The stage configs hold only keys the trainer knows (they need the pretrained folders to run).
TEST(ParamGroups, StageConfigsResolve) {
  const fs::path root = fs::path(__FILE__).parent_path() / ".." / "..";
  for (const char* f : {"configs/vlm_stage1.json", "configs/vlm_stage2.json"}) {
    json cfg = resolve_train_config(models::read_json_file((root / f).string(), "config"), f);
    EXPECT_NO_THROW(ParameterGroupRules::from_config(cfg)) << f;
  }
}
}  // namespace
}  // namespace kestrel::train
