// A complete training program with its own loop on ember::Fabric: a small CNN on Fashion-MNIST
// (the Debian package dataset-fashion-mnist), trained on any strategy and precision Ember has
// plugins for. Fabric launches the ranks, places and synchronises the model, runs the precision's
// autocast and loss scaling, and saves/loads checkpoints; the loop is this file's.
//
//   fabric_loop [--strategy ddp] [--devices 2] [--precision bf16-mixed] [--accelerator cpu]
//               [--steps 300] [--batch 64] [--lr 0.002] [--seed 42] [--threads N]
//               [--data /usr/share/datasets/fashion-mnist] [--synthetic] [--limit N]
//               [--save STATE.ckpt] [--resume STATE.ckpt] [--weights PREFIX] [--loggers csv]
//
// --synthetic trains on generated images of 10 learnable classes instead (for machines without
// the data set); --weights PREFIX writes every rank's final parameters to PREFIX.rank<k> (raw
// float32), so ranks can be compared byte for byte.
#include <ATen/CPUGeneratorImpl.h>
#include <ember/error.h>
#include <ember/fabric.h>
#include <torch/torch.h>
#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Args {
  std::string strategy = "auto", precision = "32-true", accelerator = "auto", data = "/usr/share/datasets/fashion-mnist";
  std::string save, resume, weights, loggers;
  int64_t devices = 1, steps = 300, batch = 64, threads = 0, limit = 0;
  double lr = 2e-3;
  uint64_t seed = 42;
  bool synthetic = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--synthetic") {
      a.synthetic = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value (or is unknown); see the comment at the top of fabric_loop.cpp");
    const std::string v = argv[++i];
    if (k == "--strategy") a.strategy = v;
    else if (k == "--precision") a.precision = v;
    else if (k == "--accelerator") a.accelerator = v;
    else if (k == "--data") a.data = v;
    else if (k == "--save") a.save = v;
    else if (k == "--resume") a.resume = v;
    else if (k == "--weights") a.weights = v;
    else if (k == "--loggers") a.loggers = v;
    else if (k == "--devices") a.devices = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoll(v);
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--threads") a.threads = std::stoll(v);
    else if (k == "--limit") a.limit = std::stoll(v);
    else if (k == "--lr") a.lr = std::stod(v);
    else if (k == "--seed") a.seed = std::stoull(v);
    else throw std::invalid_argument("unknown option " + k + "; see the comment at the top of fabric_loop.cpp");
  }
  return a;
}

// ---- data -----------------------------------------------------------------------------------

struct Split {
  at::Tensor images;  // float [N, 1, 28, 28], normalised
  at::Tensor labels;  // int64 [N]
};

// An idx file (big-endian header, then bytes) from its .gz.
std::vector<uint8_t> read_idx_gz(const std::string& path, int dims, std::vector<int64_t>& shape) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error(path + ": cannot open (install dataset-fashion-mnist, or pass --synthetic)");
  auto read = [&](void* p, unsigned n) {
    if (gzread(f, p, n) != static_cast<int>(n)) {
      gzclose(f);
      throw std::runtime_error(path + ": truncated or not an idx file");
    }
  };
  auto u32 = [&] {
    unsigned char b[4];
    read(b, 4);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
  };
  const uint32_t magic = u32();
  if (magic != static_cast<uint32_t>(0x800 + dims)) {
    gzclose(f);
    throw std::runtime_error(path + ": not an idx file of " + std::to_string(dims) + " dimensions");
  }
  int64_t total = 1;
  shape.clear();
  for (int d = 0; d < dims; ++d) {
    shape.push_back(u32());
    total *= shape.back();
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(total));
  for (size_t done = 0; done < bytes.size();) {
    const unsigned n = static_cast<unsigned>(std::min<size_t>(bytes.size() - done, 1 << 20));
    read(bytes.data() + done, n);
    done += n;
  }
  gzclose(f);
  return bytes;
}

Split fashion_mnist(const std::string& dir, const std::string& prefix, int64_t limit) {
  std::vector<int64_t> ishape, lshape;
  auto images = read_idx_gz(dir + "/" + prefix + "-images-idx3-ubyte.gz", 3, ishape);
  auto labels = read_idx_gz(dir + "/" + prefix + "-labels-idx1-ubyte.gz", 1, lshape);
  int64_t n = ishape[0];
  if (limit > 0) n = std::min(n, limit);
  auto x = torch::from_blob(images.data(), {ishape[0], 1, ishape[1], ishape[2]}, at::kByte).narrow(0, 0, n).to(at::kFloat);
  auto y = torch::from_blob(labels.data(), {lshape[0]}, at::kByte).narrow(0, 0, n).to(at::kLong);
  return {(x / 255.0 - 0.2860) / 0.3530, y};  // the training set's mean and std
}

// 10 classes, each a fixed random 28x28 pattern plus noise: learnable, like the real thing.
Split synthetic(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto centres = at::randn({10, 1, 28, 28}, gen);
  auto y = at::randint(0, 10, {n}, gen);
  auto x = centres.index_select(0, y) + 1.5 * at::randn({n, 1, 28, 28}, gen);
  return {x, y};
}

// ---- model ----------------------------------------------------------------------------------

struct Cnn : torch::nn::Module {
  Cnn() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // 16 x 14 x 14
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // 32 x 7 x 7
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// ---- the loop -------------------------------------------------------------------------------

void train(ember::Fabric& f, const Args& a) {
  if (a.threads > 0) at::set_num_threads(static_cast<int>(a.threads));
  f.seed_everything(a.seed);  // every rank builds the same initial weights (ddp also broadcasts rank 0's)
  const bool real = !a.synthetic;
  const Split train = real ? fashion_mnist(a.data, "train", a.limit) : synthetic(a.limit > 0 ? a.limit : 8192, a.seed);
  const Split test = real ? fashion_mnist(a.data, "t10k", a.limit > 0 ? std::min<int64_t>(a.limit, 10000) : 0)
                          : synthetic(2048, a.seed + 1);

  auto net = std::make_shared<Cnn>();
  const double lr = a.lr;
  f.setup(net, [lr](std::vector<at::Tensor> params) {
    return std::make_shared<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(lr));
  });
  int64_t step = 0;
  if (!a.resume.empty()) {
    const ember::FabricState state = f.load(a.resume);
    step = state.global_step;
    if (f.is_global_zero()) std::cout << "resumed from " << a.resume << " at step " << step << std::endl;
  }

  // Each rank trains on its share of every epoch (PyTorch's DistributedSampler), so the step count
  // alone says where in the data a resumed run goes on.
  auto sampler = f.distributed_sampler(train.images.size(0), /*shuffle=*/true, a.seed, /*drop_last=*/true);
  const int64_t per_epoch = sampler.num_samples() / a.batch;
  if (per_epoch == 0) throw ember::ConfigError("--batch " + std::to_string(a.batch) + " is more than a rank's share of the data");
  const int64_t first_step = step, window = std::max<int64_t>(1, std::min<int64_t>(10, (a.steps - step) / 3));
  std::vector<double> losses;
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  net->train();
  for (; step < a.steps; ++step) {
    const int64_t epoch = step / per_epoch, b = step % per_epoch;
    if (epoch != order_epoch) {
      sampler.set_epoch(epoch);
      order = sampler.indices();
      order_epoch = epoch;
    }
    auto idx = torch::from_blob(order.data() + b * a.batch, {a.batch}, at::kLong).clone();
    auto x = f.to_device(train.images.index_select(0, idx));
    auto y = f.to_device(train.labels.index_select(0, idx));
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    }
    f.backward(loss);
    f.optimizer_step();
    const double mean = f.all_reduce(loss.detach().to(at::kFloat), ember::ReduceOp::mean).item<double>();
    losses.push_back(mean);
    f.log("train_loss", mean, step);
  }

  // Test accuracy: every rank counts its share, the counts are summed.
  net->eval();
  ember::DistributedSampler shard(test.images.size(0), f.world_size(), f.rank(), /*shuffle=*/false, 0, /*drop_last=*/false);
  auto idx_vec = shard.indices();
  auto idx = torch::from_blob(idx_vec.data(), {static_cast<int64_t>(idx_vec.size())}, at::kLong).clone();
  at::Tensor correct;
  {
    torch::NoGradGuard no_grad;
    auto region = f.autocast(/*grad_enabled=*/false);
    auto logits = net->forward(f.to_device(test.images.index_select(0, idx)));
    correct = logits.argmax(1).eq(f.to_device(test.labels.index_select(0, idx))).sum().to(at::kDouble);
  }
  const double accuracy = f.all_reduce(correct, ember::ReduceOp::sum).item<double>() / static_cast<double>(shard.total_size());

  if (!a.save.empty()) f.save(a.save, {.global_step = step, .epoch = std::max<int64_t>(step - 1, 0) / per_epoch});
  if (!a.weights.empty()) {
    std::ofstream out(a.weights + ".rank" + std::to_string(f.rank()), std::ios::binary);
    // Gathered by the strategy: under sharded (ZeRO-3) the module holds only shards between steps.
    for (const auto& entry : f.full_model_state()) {
      auto c = entry.value().to(at::kFloat).contiguous();
      out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * sizeof(float)));
    }
  }
  if (f.is_global_zero() && !losses.empty()) {
    const auto n = static_cast<int64_t>(losses.size());
    const int64_t w = std::min(window, n);
    double head = 0, tail = 0;
    for (int64_t i = 0; i < w; ++i) head += losses[static_cast<size_t>(i)] / static_cast<double>(w);
    for (int64_t i = n - w; i < n; ++i) tail += losses[static_cast<size_t>(i)] / static_cast<double>(w);
    std::printf("%s on %lld rank(s), %s: steps %lld..%lld, loss %.4f -> %.4f (mean of %lld steps), test accuracy %.4f\n",
                f.strategy_name().c_str(), static_cast<long long>(f.world_size()), f.precision_name().c_str(),
                static_cast<long long>(first_step), static_cast<long long>(step), head, tail, static_cast<long long>(w), accuracy);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fabric_loop: %s\n", e.what());
    return 2;
  }
  try {
    std::vector<std::string> loggers;
    if (!args.loggers.empty()) loggers.push_back(args.loggers);
    ember::Fabric fabric({.accelerator = args.accelerator, .strategy = args.strategy, .precision = args.precision,
                          .devices = args.devices, .loggers = loggers, .name = "fabric_loop"});
    return fabric.launch([&](ember::Fabric& f) { train(f, args); });
  } catch (const ember::ConfigError& e) {  // a bad option: unknown strategy/precision, ...
    std::fprintf(stderr, "fabric_loop: %s\n", e.what());
    return 2;
  }
}
